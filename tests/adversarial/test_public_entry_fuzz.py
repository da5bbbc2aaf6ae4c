"""Bad inputs at every public entry, drawn at random: each is refused with a
`KVOffloadError` whose message names the parameter, shows the value and gives a fix.

The kinds (issue 21): sizes so large they overflow (past int64), `None` where a
sequence or mapping goes, dtypes the kernels cannot move (sub-byte: int4, uint4,
float4), tensors on devices DLPack cannot export (torch's meta device), and unknown
keyword arguments on public constructors. The entries: the config constructors,
`build_offloading_config`, `KVOffloader`, `GroupCaches`, `HostStore`, the host pool,
the tier configs, the torch bridge. One seed per run is printed; every case that fails
is listed with its input and what came back.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload import GroupCaches, KVOffloader
from jax_kvoffload.config import (
    CacheConfig,
    DiskTierConfig,
    EngineConfig,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVTransferConfig,
    MLAAttentionSpec,
    ModelConfig,
    OffloadingGroupConfig,
    ParallelConfig,
    RedisTierConfig,
    SlidingWindowSpec,
    build_offloading_config,
    parse_secondary_tiers,
)
from jax_kvoffload.errors import KVOffloadError
from jax_kvoffload.hostmem import HostChunkPool
from jax_kvoffload.store import HostStore
from tests.adversarial.test_error_leaks import leaks
from tests.faults._helpers import config, noise

torch = pytest.importorskip("torch")

HUGE = [2**64, 2**70, 10**30, 2**63]
SUB_BYTE = ["int4", "uint4", "float4_e2m1fn", ml_dtypes.int4, ml_dtypes.uint4]
# A fix: an imperative the caller can follow, or the form to pass ("e.g.", "like").
FIX = re.compile(
    r"\b(use|pass|set|give|call|drop|rebuild|remove|choose|move|wrap|copy|lower|reduce|"
    r"convert|view|fix|keep|like)\b|\be\.g\.",
    re.IGNORECASE,
)


@dataclasses.dataclass(frozen=True)
class Case:
    entry: str
    param: str
    value: Any
    call: Callable[[], Any]
    shown: tuple[str, ...]  # any of these in the message shows the value


def spec_kw() -> dict:
    return dict(block_size=4, num_kv_heads=2, head_size=8, dtype="bfloat16")


def engine_kw(extra: dict | None = None) -> dict:
    return dict(
        model_config=ModelConfig(model="m", dtype="bfloat16", total_num_kv_heads=2),
        cache_config=CacheConfig(block_size=4),
        kv_transfer_config=KVTransferConfig(
            kv_connector_extra_config={"cpu_bytes_to_use": 1 << 20, **(extra or {})},
            engine_id="e",
        ),
    )


def kv_config(**kw) -> KVCacheConfig:
    group = KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec=FullAttentionSpec(**spec_kw()))
    return KVCacheConfig(
        **{"num_blocks": 8, "kv_cache_tensors": (), "kv_cache_groups": (group,), **kw}
    )


def tensor(**kw):
    return torch.zeros(8, 2, 4, 16, dtype=torch.uint8, **kw)


def meta_tensor():
    return tensor(device="meta")


def worker_kw() -> dict:
    return dict(
        tensors=[(tensor(), 128)], group_refs=[[(0, 128)]], blocks_per_chunk=1, num_chunks=2
    )


def _worker(**kw):
    from jax_kvoffload.bridge.torch import TorchKVWorker

    return TorchKVWorker(**{**worker_kw(), **kw}).shutdown()


def _offloader(**kw):
    return KVOffloader(config(), GroupCaches(noise(), pk.KVLayout.nhd()), backend="xla", **kw)


def _close(obj):
    if hasattr(obj, "close"):
        obj.close()


# entry -> (call taking keyword overrides, {parameter: kinds it takes})
ENTRIES: dict[str, tuple[Callable[..., Any], dict[str, tuple[str, ...]]]] = {
    "FullAttentionSpec": (
        lambda **kw: FullAttentionSpec(**{**spec_kw(), **kw}),
        {"block_size": ("huge",), "num_kv_heads": ("huge",), "head_size": ("huge",),
         "dtype": ("sub_byte",)},
    ),
    "SlidingWindowSpec": (
        lambda **kw: SlidingWindowSpec(**{**spec_kw(), "sliding_window": 8, **kw}),
        {"sliding_window": ("huge",), "head_size": ("huge",), "dtype": ("sub_byte",)},
    ),
    "MLAAttentionSpec": (
        lambda **kw: MLAAttentionSpec(**{**spec_kw(), "num_kv_heads": 1, **kw}),
        {"head_size": ("huge",), "dtype": ("sub_byte",)},
    ),
    "KVCacheTensor": (
        lambda **kw: KVCacheTensor(**{"size": 64, "layers": ("l0",), "layer_stride": 64,
                                      "block_stride": 8, **kw}),
        {"size": ("huge",), "layers": ("none",), "block_stride": ("huge",)},
    ),
    "KVCacheGroupSpec": (
        lambda **kw: KVCacheGroupSpec(
            **{"layer_names": ("l0",), "kv_cache_spec": FullAttentionSpec(**spec_kw()), **kw}
        ),
        {"layer_names": ("none",)},
    ),
    "KVCacheConfig": (
        kv_config,
        {"num_blocks": ("huge",), "kv_cache_tensors": ("none",), "kv_cache_groups": ("none",)},
    ),
    "ModelConfig": (
        lambda **kw: ModelConfig(**{"model": "m", "dtype": "bfloat16", "total_num_kv_heads": 2,
                                    **kw}),
        {"dtype": ("sub_byte",), "total_num_kv_heads": ("huge",), "max_model_len": ("huge",)},
    ),
    "CacheConfig": (
        lambda **kw: CacheConfig(**kw),
        {"block_size": ("huge",), "cache_dtype": ("sub_byte",)},
    ),
    "ParallelConfig": (
        lambda **kw: ParallelConfig(**kw),
        {"tensor_parallel_size": ("huge",), "pipeline_parallel_size": ("huge",)},
    ),
    "KVTransferConfig": (lambda **kw: KVTransferConfig(**kw), {}),
    "EngineConfig": (lambda **kw: EngineConfig(**{**engine_kw(), **kw}), {}),
    "OffloadingGroupConfig": (
        lambda **kw: OffloadingGroupConfig(
            **{"tokens_per_block": 4, "layer_names": ("l0",), "group_id": 0, **kw}
        ),
        # vLLM's results: sizes are kept as vLLM computes them (the consumers bound them)
        {"layer_names": ("none",)},
    ),
    "build_offloading_config": (
        lambda **kw: build_offloading_config(EngineConfig(**engine_kw()), kv_config(**kw)),
        {"num_blocks": ("huge",), "kv_cache_groups": ("none",)},
    ),
    "KVOffloader": (
        _offloader,
        {"cpu_bytes_to_use": ("huge",), "max_bucket": ("huge",)},
    ),
    "KVOffloader(extra)": (
        lambda **kw: KVOffloader(config(**kw), GroupCaches(noise(), pk.KVLayout.nhd()),
                                 backend="xla"),
        {"cpu_bytes_to_use": ("huge",), "blocks_per_chunk": ("huge",),
         "secondary_tiers": ("none_item",)},
    ),
    "GroupCaches": (
        lambda **kw: GroupCaches(**{"arrays": noise(), "layout": pk.KVLayout.nhd(), **kw}),
        {"arrays": ("none", "sub_byte_arrays")},
    ),
    "HostStore": (
        lambda **kw: HostStore(**{"num_chunks": 4, **kw}),
        {"num_chunks": ("huge",), "store_threshold": ("huge",), "max_tracker_size": ("huge",)},
    ),
    "HostStore.from_cpu_budget": (
        lambda **kw: HostStore.from_cpu_budget(**{"cpu_bytes_to_use": 1 << 20,
                                                  "worker_kv_bytes_per_block": 64,
                                                  "blocks_per_chunk": 2, **kw}),
        {"cpu_bytes_to_use": ("huge",), "worker_kv_bytes_per_block": ("huge",),
         "blocks_per_chunk": ("huge",)},
    ),
    "HostChunkPool": (
        lambda **kw: HostChunkPool(**{"num_chunks": 4, "bytes_per_block": {0: 64},
                                      "blocks_per_chunk": 2, **kw}),
        {"num_chunks": ("huge",), "bytes_per_block": ("none", "huge_map"),
         "blocks_per_chunk": ("huge",)},
    ),
    "DiskTierConfig": (
        lambda **kw: DiskTierConfig(**{"path": "/tmp/jkv-fuzz", "capacity_bytes": 1 << 20, **kw}),
        {"path": ("none",), "capacity_bytes": ("huge",), "max_pending_store_bytes": ("huge",)},
    ),
    "RedisTierConfig": (
        lambda **kw: RedisTierConfig(**{"url": "redis://127.0.0.1:1/0", **kw}),
        {"url": ("none",), "batch_bytes": ("huge",), "seed_urls": ("none_item",)},
    ),
    "parse_secondary_tiers": (
        lambda **kw: parse_secondary_tiers(
            [{"type": "disk", "path": "/tmp/jkv-fuzz", "capacity_bytes": 1 << 20, **kw}]
        ),
        {"path": ("none",), "capacity_bytes": ("huge",), "read_threads": ("huge",)},
    ),
    "to_jax": (
        lambda tensor: __import__("jax_kvoffload.bridge.torch", fromlist=["x"]).to_jax(tensor),
        {"tensor": ("meta", "sub_byte_tensor")},
    ),
    "raw_pages": (
        lambda tensor: __import__("jax_kvoffload.bridge.torch", fromlist=["x"]).raw_pages(tensor),
        {"tensor": ("meta",)},
    ),
    "TorchKVWorker": (
        _worker,
        {"tensors": ("none", "meta_pair"), "group_refs": ("none",), "num_chunks": ("huge",),
         "blocks_per_chunk": ("huge",)},
    ),
}  # fmt: skip

# Entries whose parameters are keywords (an unknown one is a mistake worth a message).
POSITIONAL = ("to_jax", "raw_pages", "parse_secondary_tiers", "build_offloading_config",
              "KVOffloader(extra)")  # fmt: skip
KEYWORD_ENTRIES = [e for e in ENTRIES if e not in POSITIONAL]


def show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor({value.dtype}, {value.device})"
    return repr(value)[:60]


def bad_value(kind: str, rng: np.random.Generator) -> tuple[Any, tuple[str, ...]]:
    """A bad value of `kind` and the texts any of which shows it in a message."""
    if kind == "huge":
        v = int(rng.choice(HUGE)) * int(rng.choice([1, 3]))
        return v, (str(v), f"{v.bit_length()} bits")
    if kind == "none":
        return None, ("None",)
    if kind == "none_item":
        return [None], ("None",)
    if kind == "sub_byte":
        v = SUB_BYTE[int(rng.integers(0, len(SUB_BYTE)))]
        return v, (str(np.dtype(getattr(ml_dtypes, v)) if isinstance(v, str) else np.dtype(v)),)
    if kind == "sub_byte_arrays":
        dt = [jnp.int4, jnp.uint4][int(rng.integers(0, 2))]
        return [jnp.zeros((8, 4, 2, 8), dt) for _ in range(2)], (np.dtype(dt).name,)
    if kind == "sub_byte_tensor":
        dt = [torch.uint4, torch.int4, torch.uint2][int(rng.integers(0, 3))]
        return torch.zeros(16, dtype=torch.uint8).view(dt), (str(dt).removeprefix("torch."),)
    if kind == "meta":
        return meta_tensor(), ("meta",)
    if kind == "meta_pair":
        return [(meta_tensor(), 128)], ("meta",)
    if kind == "huge_map":
        v = int(rng.choice(HUGE))
        return {0: v}, (str(v),)
    raise AssertionError(kind)


def draw(rng: np.random.Generator) -> Case:
    if rng.random() < 0.2:
        entry = str(rng.choice(KEYWORD_ENTRIES))
        call, params = ENTRIES[entry]
        real = sorted(params) or ["engine_id"]
        name = str(rng.choice(real)) + str(rng.choice(["s", "_size", "x"]))
        return Case(entry, name, 1, lambda: call(**{name: 1}), (name,))
    entry = str(rng.choice([e for e, (_, p) in ENTRIES.items() if p]))
    call, params = ENTRIES[entry]
    param = str(rng.choice(sorted(params)))
    kind = str(rng.choice(params[param]))
    value, shown = bad_value(kind, rng)
    return Case(entry, param, value, lambda: call(**{param: value}), shown)


def verdict(case: Case) -> str | None:
    """None if the case was refused as it should be, else what went wrong."""
    try:
        _close(case.call())
    except KVOffloadError as e:
        message = str(e)
        if case.param not in message:
            return f"names no parameter {case.param!r}: {message}"
        if not any(s in message for s in case.shown):
            return f"shows no value {case.shown}: {message}"
        if not FIX.search(message):
            return f"gives no fix: {message}"
        if leaked := leaks(message, []):  # internals of the parts, raw bytes
            return f"leaks {leaked}: {message}"
        return None
    except Exception as e:
        return f"untyped {type(e).__name__}: {e}"
    return "accepted"


def test_bad_inputs_at_public_entries_say_what_to_fix():
    seed = int(os.environ.get("JKV_FUZZ_SEED", np.random.SeedSequence().entropy % 2**32))
    print(f"seed={seed} (rerun with JKV_FUZZ_SEED={seed})")
    rng = np.random.default_rng(seed)
    cases = [draw(rng) for _ in range(120)]
    failures = [(c, why) for c in cases if (why := verdict(c)) is not None]
    report = "\n".join(
        f"  {c.entry}({c.param}={show(c.value)}): {why[:300]}" for c, why in failures
    )
    assert len(failures) <= len(cases) * 3 // 100, f"seed={seed}\n{report}"
    assert not failures, f"seed={seed}: {len(failures)} of {len(cases)} failed\n{report}"


def test_every_entry_and_kind_once():
    """The whole space, each (entry, parameter, kind) once: the class, not a sample."""
    rng = np.random.default_rng(0)
    failures = []
    for entry, (call, params) in ENTRIES.items():
        for param, kinds in params.items():
            for kind in kinds:
                value, shown = bad_value(kind, rng)
                case = Case(entry, param, value, lambda c=call, p=param, v=value: c(**{p: v}),
                            shown)  # fmt: skip
                if (why := verdict(case)) is not None:
                    failures.append(f"  {entry}({param}={show(value)}): {why[:300]}")
    for entry in KEYWORD_ENTRIES:
        call = ENTRIES[entry][0]
        case = Case(entry, "bogus_option", 1, lambda c=call: c(bogus_option=1), ("bogus_option",))
        if (why := verdict(case)) is not None:
            failures.append(f"  {entry}(bogus_option=1): {why[:300]}")
    assert not failures, "\n".join(failures)
