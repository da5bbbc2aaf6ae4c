"""The differential check: vLLM 0.33.0's `build_offloading_config` against ours, on one
case drawn from vLLM's space (`vllm_space.draw_case`). Used only when vLLM imports.

`check_case(case)` returns the differences it found (empty when ours agrees), in
three comparisons:

1. Topology: our `ParallelConfig` accepts a TP/PCP/DCP triple exactly when vLLM's does.
2. The vLLM path: `offloading_config_from_vllm` on the same vLLM objects. Results equal
   field by field (and `extra_config` values keep their Python types, as vLLM's consumers
   check `isinstance(..., list)`); errors in the same family (vLLM's `TypeError`,
   `OverflowError`, `ZeroDivisionError` -> ours is one too; vLLM's `ValueError` or
   `AssertionError` -> our typed `ValueError`), under the same rule (vLLM's wording), and
   the set of attributes read from vLLM's config objects equal (a property vLLM does
   not read is not read).
3. The JAX path: our `build_offloading_config` on our own (validating) classes built
   from the same values; same result or error family, except where our constructors
   refuse a value no engine runs with (docs/config.md).

The deliberate differences of docs/config.md are recognised by `_documented`, each by
the exact condition the docs state; anything else is a failure.
"""

from __future__ import annotations

import math
from typing import Any

from vllm.config import ParallelConfig as VllmParallelConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config as vllm_build,
)

from jax_kvoffload import config as ours
from jax_kvoffload.bridge.vllm import convert_engine_config, offloading_config_from_vllm
from jax_kvoffload.errors import KVOffloadError

from . import vllm_objects
from .vllm_space import Case

# vLLM's own words for the rules that fire before the chunk options are parsed.
_EARLY_RULES = ("KV offloading found no eligible", "Invalid prefix_match_unit", "tokens_per_block=")
# Messages Python itself writes inside vLLM (int(), arithmetic): we write our own.
_PYTHON_WORDS = ("int()", "literal", "convert", "Exceeds the limit", "division", "modulo")


def _run(fn: Any) -> tuple[Any, BaseException | None]:
    try:
        return fn(), None
    except Exception as exc:
        return None, exc


def _chunk_option(case: Case) -> tuple[str | None, Any]:
    """The extra-config key vLLM passes to int(), and its value."""
    if case.transfer is None:
        return None, None
    extra = case.transfer.kv_connector_extra_config
    bpc, bs = extra.get("blocks_per_chunk"), extra.get("block_size")
    if bpc is not None and bs is not None:
        return None, None
    if bpc is not None:
        return "blocks_per_chunk", bpc
    if bs is not None:
        return "block_size", bs
    return None, None


def _documented(case: Case, expected: Any, v_exc: BaseException | None, o_exc: Any) -> str:
    """The docs/config.md difference this outcome is, or "" if none."""
    if not isinstance(o_exc, ours.OffloadConfigError):
        return ""
    if (
        isinstance(o_exc, ours.ConfigFieldError)
        and "block holds at least one token" in str(o_exc)
        and not (v_exc is not None and str(v_exc).startswith(_EARLY_RULES[:1]))
        and any(s.block_size < 1 for s in _layer_specs(case))
    ):
        return "spec block_size < 1"
    _, value = _chunk_option(case)
    early = v_exc is not None and str(v_exc).startswith(_EARLY_RULES)
    if (
        isinstance(value, float)
        and math.isfinite(value)
        and not value.is_integer()
        and "not a whole number" in str(o_exc)
        and not early
    ):
        return "non-integral float chunk option"
    if expected is None:
        return ""
    if expected.cache.blocks_per_chunk < 0 and "'block_size' must be >= 0" in str(o_exc):
        return "negative block_size"
    return ""


def _family_problem(v_exc: BaseException, o_exc: BaseException | None) -> str:
    if o_exc is None:
        return f"vLLM raised {type(v_exc).__name__}({v_exc}); ours returned a config"
    if type(o_exc) is type(v_exc) and str(o_exc) == str(v_exc):
        return ""  # the same error, raised by vLLM's own config object (a property)
    if not isinstance(o_exc, KVOffloadError):
        return f"ours raised a foreign {type(o_exc).__name__}({o_exc}) for vLLM's {v_exc!r}"
    # vLLM's assert becomes our typed ValueError; every other family is kept.
    families = (AssertionError, TypeError, OverflowError, ZeroDivisionError, ValueError)
    family = next((f for f in families if isinstance(v_exc, f)), None)
    if family is None:
        return f"vLLM raised an unexpected {type(v_exc).__name__}({v_exc})"
    expected_family = ValueError if family is AssertionError else family
    if not isinstance(o_exc, expected_family):
        return (
            f"family: vLLM raised {type(v_exc).__name__}({v_exc}), ours "
            f"{type(o_exc).__name__}({o_exc}), not a {expected_family.__name__}"
        )
    words = str(v_exc)
    if (
        words
        and isinstance(v_exc, (ValueError, AssertionError))
        and not any(w in words for w in _PYTHON_WORDS)
    ):
        head = words.split(". ")[0][:40]
        if head not in str(o_exc):
            return f"rule: vLLM said {words!r}, ours {o_exc!r}"
    return ""


def _result_problem(expected: Any, actual: Any) -> str:
    want, got = vllm_objects.as_plain(expected), vllm_objects.as_plain(actual)
    if want != got:
        fields = [k for k in want if want[k] != got.get(k)]
        return "fields differ: " + "; ".join(
            f"{k}: vLLM {want[k]!r}, ours {got[k]!r}" for k in fields
        )
    for key, value in expected.extra_config.items():
        if type(actual.extra_config[key]) is not type(value):
            return (
                f"extra_config[{key!r}] is a {type(actual.extra_config[key]).__name__} in "
                f"ours, a {type(value).__name__} in vLLM's (its consumers check the type)"
            )
    return ""


def _compare(case: Case, expected: Any, v_exc: Any, actual: Any, o_exc: Any, arm: str) -> list:
    if _documented(case, expected, v_exc, o_exc):
        return []
    if v_exc is None:
        if o_exc is not None:
            return [f"{arm}: vLLM returned a config, ours raised {type(o_exc).__name__}({o_exc})"]
        problem = _result_problem(expected, actual)
        return [f"{arm}: {problem}"] if problem else []
    problem = _family_problem(v_exc, o_exc)
    return [f"{arm}: {problem}"] if problem else []


def _parallel_problem(case: Case) -> str:
    kw = case.parallel_kwargs
    sizes = {
        k: kw[k]
        for k in (
            "tensor_parallel_size",
            "prefill_context_parallel_size",
            "decode_context_parallel_size",
        )
    }
    _, v_exc = _run(lambda: VllmParallelConfig(**sizes))
    _, o_exc = _run(lambda: ours.ParallelConfig(**sizes))
    if (v_exc is None) != (o_exc is None):
        verdict = "accepts" if v_exc is None else f"refuses ({v_exc})"
        return f"topology {sizes}: vLLM {verdict}, ours {'accepts' if o_exc is None else o_exc}"
    if o_exc is not None and not isinstance(o_exc, ours.ConfigFieldError):
        return f"topology {sizes}: ours refuses with {type(o_exc).__name__}, not a ConfigFieldError"
    return ""


def check_case(case: Case) -> tuple[list[str], str]:
    """The differences found, and vLLM's outcome as a label for coverage counts."""
    problems = []
    topology = _parallel_problem(case)
    if topology:
        problems.append(topology)
    if isinstance(case.parallel, BaseException):
        return problems, "topology refused by vLLM"

    v_log: set = set()
    o_log: set = set()
    expected, v_exc = _run(lambda: vllm_build(case.vllm_config(v_log), case.kv))
    actual, o_exc = _run(lambda: offloading_config_from_vllm(case.vllm_config(o_log), case.kv))
    found = _compare(case, expected, v_exc, actual, o_exc, "vLLM objects")
    problems += found
    if not found and not _documented(case, expected, v_exc, o_exc) and v_log != o_log:
        problems.append(
            f"vLLM objects: reads differ: only ours read {sorted(o_log - v_log)}, "
            f"only vLLM read {sorted(v_log - o_log)}"
        )
    problems += _jax_path(case, expected, v_exc)
    label = "config" if v_exc is None else type(v_exc).__name__
    return problems, label


def _jax_path(case: Case, expected: Any, v_exc: Any) -> list[str]:
    if case.transfer is not None and case.transfer.engine_id is None:
        return []  # our KVTransferConfig invents an id there, as vLLM's constructor does
    plain = case.vllm_config(set())
    engine, exc = _run(lambda: convert_engine_config(plain))
    if exc is not None:
        # Reading every attribute up front raises where vLLM's property does.
        if isinstance(exc, ValueError) and not isinstance(exc, KVOffloadError):
            return []
        return [f"our classes: the engine does not convert: {type(exc).__name__}({exc})"]
    kv, exc = _run(lambda: vllm_objects.ours_validated_kv_cache_config(case.kv))
    if exc is not None:
        if isinstance(exc, (ours.ConfigFieldError, ours.ConfigTypeError)) and _degenerate(case):
            return []  # our constructors refuse what no engine runs with (documented)
        return [f"our classes: the KV cache does not convert: {type(exc).__name__}({exc})"]
    actual, o_exc = _run(lambda: ours.build_offloading_config(engine, kv))
    return _compare(case, expected, v_exc, actual, o_exc, "our classes")


def _layer_specs(case: Case) -> list:
    out = []
    for g in case.kv.kv_cache_groups:
        spec = g.kv_cache_spec
        out += [spec, *getattr(spec, "kv_cache_specs", {}).values()]
    return out


def _degenerate(case: Case) -> bool:
    """A spec value our constructors refuse on purpose: a zero block, window, chunk or
    head count, or padding below the page."""
    for s in _layer_specs(case):
        if s.block_size < 1 or getattr(s, "sliding_window", 1) == 0:
            return True
        if getattr(s, "num_kv_heads", 1) < 1:  # an attention layer without heads
            return True
        if getattr(s, "attention_chunk_size", 1) == 0:
            return True
        padded = getattr(s, "page_size_padded", None)
        if padded is not None and padded < getattr(s, "real_page_size_bytes", 0):
            return True
    return False


def summary(labels: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(labels.items(), key=lambda kv: -kv[1]))
