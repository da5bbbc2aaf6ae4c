"""Our translation against vLLM 0.33.0's own, on inputs drawn from vLLM's space.

Skipped unless vLLM is importable (see docs/vllm.md for the CPU-only install).

`test_differential_against_vllm` draws `JAX_KVOFFLOAD_DIFF_CASES` cases (default 1000,
about 4 s)
with vLLM's own config classes (`vllm_space.py`) and compares vLLM's
`build_offloading_config` with ours on each (`vllm_diff.py`: results field by field,
error families, attribute reads, our own classes too). The seed is random per run and
printed; replay a run with `JAX_KVOFFLOAD_DIFF_SEED=<seed>`, one case of it with
`JAX_KVOFFLOAD_DIFF_CASE=<i>`. The mutation tests below reintroduce known differences
and check that the comparison catches each, so the suite cannot pass vacuously.
The named cases (vLLM's own test scenarios) come last.
"""

from __future__ import annotations

import collections
import os
import random

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
vllm = pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed")

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (  # noqa: E402
    build_offloading_config as vllm_build,
)

from jax_kvoffload.bridge import _vllm_config  # noqa: E402
from jax_kvoffload.bridge.vllm import offloading_config_from_vllm  # noqa: E402
from jax_kvoffload.config import (  # noqa: E402
    ChunkSizeError,
    ConfigFieldError,
    OffloadConfigError,
    _engine,  # the mutation tests patch the private rule functions
    _translate,
)
from jax_kvoffload.config.internals import FrozenDict, freeze  # noqa: E402

from ..config import harness  # noqa: E402
from . import vllm_diff, vllm_objects, vllm_space  # noqa: E402

pytestmark = pytest.mark.vllm

SEED = os.environ.get("JAX_KVOFFLOAD_DIFF_SEED") or str(random.SystemRandom().randrange(10**9))
N_CASES = int(os.environ.get("JAX_KVOFFLOAD_DIFF_CASES", "1000"))
ONLY = os.environ.get("JAX_KVOFFLOAD_DIFF_CASE")


def run_cases(seed: str, n: int, only: str | None = None) -> tuple[list[str], dict[str, int]]:
    """Differences found over `n` cases of `seed`, and vLLM's outcomes counted."""
    vllm_space.external_launcher_env()
    failures: list[str] = []
    labels: dict[str, int] = collections.Counter()
    indices = [int(only)] if only is not None else range(n)
    for i in indices:
        case_seed = f"{seed}:{i}"
        case = vllm_space.draw_case(random.Random(case_seed), case_seed)
        problems, label = vllm_diff.check_case(case)
        labels[label] += 1
        labels[f"archetype {case.archetype}"] += 1
        failures += [f"case {i}: {p}\n    {case.describe()}" for p in problems]
    return failures, labels


def test_differential_against_vllm():
    failures, labels = run_cases(SEED, N_CASES, ONLY)
    print(f"seed {SEED}: {N_CASES} cases; vLLM outcomes {vllm_diff.summary(labels)}")
    assert not failures, (
        f"{len(failures)} differences from vLLM 0.33.0 (seed {SEED}; replay with "
        f"JAX_KVOFFLOAD_DIFF_SEED={SEED} [JAX_KVOFFLOAD_DIFF_CASE=i]):\n" + "\n".join(failures[:12])
    )
    if ONLY is None:
        # The draw reaches every outcome family, or the comparison proves little.
        for label in ("config", "ValueError", "AssertionError", "TypeError"):
            assert labels[label] >= 5, (label, dict(labels))
        assert labels["topology refused by vLLM"] >= 5, dict(labels)


# ---------------------------------------------------------------- extra_config for vLLM

TIERS = {"secondary_tiers": [{"type": "example", "backpressure": {}}], "block_size": 32}


def _tiering_spec():
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    return TieringOffloadingSpec


def test_vllms_tiering_spec_accepts_our_extra_config():
    # vLLM's tiering spec checks isinstance(secondary_tiers, list) and each tier is a
    # dict; our config hands out fresh lists and dicts, and stays hashable.
    case = tiers_case()
    ours = offloading_config_from_vllm(case.vllm_config(set()), case.kv)
    tiers = _tiering_spec()._get_secondary_tiers(ours.extra_config)
    assert [t for t, _ in tiers] == TIERS["secondary_tiers"]
    assert hash(ours) == hash(offloading_config_from_vllm(case.vllm_config(set()), case.kv))


def test_our_offloading_config_keeps_vllms_structures():
    from jax_kvoffload.bridge.vllm import our_offloading_config

    case = tiers_case()
    theirs = vllm_build(case.vllm_config(set()), case.kv)
    ours = our_offloading_config(theirs)
    assert vllm_objects.as_plain(ours) == vllm_objects.as_plain(theirs)
    _tiering_spec()._get_secondary_tiers(ours.extra_config)  # no "must be a list"
    assert type(ours.extra_config["secondary_tiers"][0]["backpressure"]) is dict
    ours.extra_config["secondary_tiers"].append("junk")  # a consumer's own copy
    assert ours.extra_config["secondary_tiers"] == TIERS["secondary_tiers"]
    hash(ours)


def tiers_case() -> vllm_space.Case:
    from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig
    from vllm.v1 import kv_cache_interface as kci

    torch = vllm_space.torch
    spec = kci.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    group = kci.KVCacheGroupSpec(layer_names=["a", "b"], kv_cache_spec=spec)
    return vllm_space.Case(
        seed="tiers",
        parallel=ParallelConfig(),
        parallel_kwargs={},
        cache=CacheConfig(block_size=16),
        model=vllm_space.ModelStandIn("m", torch.bfloat16, False, 4096, 2),
        transfer=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=dict(TIERS),
            engine_id="engine-0",
        ),
        events=None,
        use_v2_model_runner=False,
        kv=kci.KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group]),
        archetype="dense",
    )


# ---------------------------------------------------------------- the suite can fail
# Each mutation reintroduces a difference this library once had (issue 11); the
# comparison must report it. A fixed seed keeps these deterministic.


def _old_check_dcp(tp, pcp, dcp):
    # Before: tp % dcp == 0 always, which refuses valid PCP+DCP engines.
    if tp % dcp:
        raise ConfigFieldError("decode_context_parallel_size", "tp % dcp != 0")


def _old_parse_int(extra, key):
    # Before: every int() failure became a ValueError, lists and dicts included.
    try:
        return int(extra[key])
    except (TypeError, ValueError):
        raise ChunkSizeError(f"{key!r} is not an integer") from None


def _eager(read):
    # Before: the adapter read vLLM's properties up front, whatever the path.
    original = _vllm_config.build_offloading_config

    def build(vllm_config, kv_cache_config):
        read(vllm_config)
        return original(vllm_config, kv_cache_config)

    return build


def _refuse_zero_heads(vllm_config):
    if vllm_config.model_config.get_total_num_kv_heads() < 1:
        raise ConfigFieldError("total_num_kv_heads", "must be >= 1")


MUTATIONS = {
    "tp % dcp checked with PCP too": (_engine, "_check_dcp", _old_check_dcp, "topology"),
    "int() TypeError reported as ValueError": (
        _translate,
        "_parse_int",
        _old_parse_int,
        "not a TypeError",
    ),
    "extra_config deep-frozen (lists read back as tuples)": (
        FrozenDict,
        "__getitem__",
        lambda self, key: freeze(self._data[key]),
        "extra_config[",
    ),
    "nnodes_within_dp read eagerly": (
        _vllm_config,
        "build_offloading_config",
        _eager(lambda c: c.parallel_config.nnodes_within_dp),
        "nnodes_within_dp",
    ),
    "model dtype read when cache_dtype is set": (
        _vllm_config,
        "build_offloading_config",
        _eager(lambda c: c.model_config.dtype),
        "('model_config', 'dtype')",
    ),
    "zero KV heads refused up front": (
        _vllm_config,
        "build_offloading_config",
        _eager(_refuse_zero_heads),
        "get_total_num_kv_heads",
    ),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_the_comparison_catches_a_reintroduced_difference(monkeypatch, name):
    target, attr, replacement, evidence = MUTATIONS[name]
    monkeypatch.setattr(target, attr, replacement)
    failures, _ = run_cases("mutations", 400)
    assert failures, f"{name}: 400 cases found no difference"
    assert any(evidence in f for f in failures), (name, failures[:3])


# ---------------------------------------------------------------- vLLM's named cases


def compare(engine, kv):
    """Runs both translations; asserts equal results or errors under the same condition."""
    vcfg = vllm_objects.vllm_config(engine)
    vkv = vllm_objects.kv_cache_config(kv)
    try:
        expected = vllm_build(vcfg, vkv)
    except (ValueError, AssertionError, ZeroDivisionError) as exc:
        with pytest.raises(OffloadConfigError) as ours:
            offloading_config_from_vllm(vcfg, vkv)
        # Same rule: vLLM's message text is kept wherever vLLM writes one (Python's own
        # int() parse and division errors are replaced by messages naming the key).
        if str(exc) and not isinstance(exc, ZeroDivisionError) and "literal" not in str(exc):
            assert str(exc).split(".")[0][:40] in str(ours.value), (str(exc), str(ours.value))
        return None
    if expected.cache.blocks_per_chunk < 0:  # a documented difference (docs/config.md)
        with pytest.raises(OffloadConfigError, match="'block_size' must be >= 0"):
            offloading_config_from_vllm(vcfg, vkv)
        return None
    actual = offloading_config_from_vllm(vcfg, vkv)
    assert vllm_objects.as_plain(actual) == vllm_objects.as_plain(expected)
    return actual


def test_vllm_is_the_pinned_version():
    assert vllm.__version__ == "0.33.0"


CASES = {
    "a1_tp3_pp2": (
        dict(extra={"block_size": 32}, tp=3, pp=2),
        dict(
            groups=[(harness.full(16, 1, 1, "float32"), ("l0", "l1"))], num_blocks=4, packed_page=8
        ),
    ),
    "a6_pcp": (dict(extra={"block_size": 64}, pcp=2), dict(groups=[(harness.full(), ("l0",))])),
    "a7_dcp_mamba": (
        dict(tp=2, dcp=2),
        dict(groups=[(harness.full(16), ("a",)), (harness.mamba(16, "align"), ("b",))]),
    ),
    "a10_hetero": (
        dict(block_size=4, extra={"blocks_per_chunk": 2}),
        dict(groups=[(harness.full(12), ("a",)), (harness.mla(16, 512), ("b",))]),
    ),
    "a10_hetero_block_size": (
        dict(block_size=4, extra={"block_size": 48}),
        dict(groups=[(harness.full(12), ("a",)), (harness.mla(16, 512), ("b",))]),
    ),
    "a13_not_multiple": (dict(extra={"block_size": 40}), dict(groups=[(harness.full(), ("a",))])),
    "a13_zero": (dict(extra={"block_size": 0}), dict(groups=[(harness.full(), ("a",))])),
    "a12_zero_bpc": (
        dict(extra={"blocks_per_chunk": "0"}),
        dict(groups=[(harness.full(), ("a",))]),
    ),
    "a14_rings": (dict(), dict(groups=[(harness.ring(4), ("a",)), (harness.ring(8), ("b",))])),
    "a16_mamba_none": (
        dict(),
        dict(groups=[(harness.full(16), ("a",)), (harness.mamba(24, "none"), ("b",))]),
    ),
    "ar1_mla_replicated": (
        dict(use_mla=True, tp=4),
        dict(
            groups=[(harness.mla(16, 512, "float32"), ("m0", "m1"))],
            num_blocks=4,
            packed_page=harness.mla(16, 512, "float32").page_size_bytes,
            kv_tp_replicas=4,
        ),
    ),
    "ar5_canonical_mla_uni": (
        dict(extra={"canonical_layout": True}, use_mla=True, distributed_executor_backend="uni"),
        dict(groups=[(harness.mla(), ("m",))]),
    ),
    "ap5_canonical_gqa": (
        dict(extra={"canonical_layout": "false"}, tp=4, total_kv_heads=2),
        dict(groups=[(harness.full(16, 1), ("a",))]),
    ),
    "b2_single_group_unit": (
        dict(tp=2, dcp=2, block_size=64, prefix_match_unit=16),
        dict(groups=[(harness.full(16), ("a",))]),
    ),
}


def build_case(engine_kw, kv_kw):
    extra = engine_kw.pop("extra", None)
    engine = harness.engine(extra, **engine_kw)
    groups = [harness.group(spec, *names) for spec, names in kv_kw["groups"]]
    tensors = ()
    if "packed_page" in kv_kw:
        names = tuple(n for g in groups for n in g.layer_names)
        tensors = (harness.packed_tensor(names, kv_kw["packed_page"], kv_kw["num_blocks"]),)
    kv = harness.kv_config(
        *groups,
        num_blocks=kv_kw.get("num_blocks", 0),
        tensors=tensors,
        kv_tp_replicas=kv_kw.get("kv_tp_replicas", 1),
    )
    return engine, kv


@pytest.mark.parametrize("name", sorted(CASES))
def test_named_cases_match_vllm(name):
    engine_kw, kv_kw = CASES[name]
    compare(*build_case(dict(engine_kw), kv_kw))
