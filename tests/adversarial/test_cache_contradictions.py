"""Caches that contradict their config, drawn from the engine's side of the space.

A model (heads, head size, block size, layers, dtype, layout) gives a config; its caches
are then built with one property changed. Every such cache is refused at
`KVOffloader(...)` (and a dtype change at `set_caches`) with a
`CacheConfigMismatchError` naming the config's value and the arrays'; the unchanged
caches, uint words of the config's width, local and global arrays of a TP config all
pass. The old check compared only the dtype's width and never the bytes per block: a
float16 cache under a bfloat16 config, or another head size, passed.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload import GroupCaches, KVOffloader
from jax_kvoffload.config import (
    CacheConfig,
    EngineConfig,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    build_offloading_config,
)
from jax_kvoffload.offloader import CacheConfigMismatchError

NB = 8
DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn", "int8", "float8_e5m2"]
SEP, SECOND = pk.KVStacking.SEPARATE, pk.KVStacking.SECOND
LAYOUTS = {
    "nhd": pk.KVLayout.nhd(SEP),
    "hnd": pk.KVLayout.hnd(SEP),
    "nhd stacked": pk.KVLayout.nhd(SECOND),
}


@dataclasses.dataclass(frozen=True)
class Model:
    heads: int
    head_size: int
    block_size: int
    layers: int
    dtype: str
    layout: str
    tp: int = 1


def config(m: Model):
    spec = FullAttentionSpec(
        block_size=m.block_size, num_kv_heads=m.heads // m.tp, head_size=m.head_size,
        dtype=m.dtype,
    )  # fmt: skip
    engine = EngineConfig(
        model_config=ModelConfig(model="m", dtype=m.dtype, total_num_kv_heads=m.heads),
        cache_config=CacheConfig(block_size=m.block_size),
        parallel_config=ParallelConfig(tensor_parallel_size=m.tp),
        kv_transfer_config=KVTransferConfig(
            kv_connector_extra_config={"cpu_bytes_to_use": 1 << 20, "blocks_per_chunk": 2},
            engine_id="e",
        ),
    )
    names = tuple(f"l{i}" for i in range(m.layers))
    kv = KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec),),
    )
    return build_offloading_config(engine, kv)


def caches(m: Model, dtype: str | None = None) -> GroupCaches:
    layout = LAYOUTS[m.layout]
    page = {
        "nhd": (m.block_size, m.heads, m.head_size),
        "hnd": (m.heads, m.block_size, m.head_size),
        "nhd stacked": (2, m.block_size, m.heads, m.head_size),
    }[m.layout]
    n = m.layers if layout.kv_stacking is SECOND else 2 * m.layers
    dt = np.dtype(getattr(ml_dtypes, dtype or m.dtype, None) or (dtype or m.dtype))
    return GroupCaches([jnp.zeros((NB, *page), dt) for _ in range(n)], layout)


def draw_model(rng: np.random.Generator) -> Model:
    return Model(
        heads=int(rng.choice([1, 2, 4])),
        head_size=int(rng.choice([4, 8, 16])),
        block_size=int(rng.choice([2, 4, 8])),
        layers=int(rng.integers(1, 4)),
        dtype=str(rng.choice(DTYPES)),
        layout=str(rng.choice(list(LAYOUTS))),
    )


def other(rng: np.random.Generator, value: int, choices: list[int]) -> int:
    return int(rng.choice([c for c in choices if c != value]))


def block_bytes(m: Model) -> int:
    itemsize = np.dtype(getattr(ml_dtypes, m.dtype, None) or m.dtype).itemsize
    return 2 * m.block_size * m.heads * m.head_size * itemsize * m.layers


def contradiction(rng: np.random.Generator, m: Model) -> tuple[str, GroupCaches, tuple[str, ...]]:
    """One property of the caches changed: (what, caches, what the message must name:
    the config's value and the arrays')."""
    what = str(rng.choice(["dtype", "heads", "head_size", "block_size", "layers"]))
    if what == "dtype":
        got = str(rng.choice([d for d in DTYPES if d != m.dtype]))
        return what, caches(m, got), (f"config's KV cache dtype is {m.dtype!r}", got)
    choices = {"block_size": [2, 4, 8, 16], "layers": [1, 2, 3, 4]}.get(what, [1, 2, 4, 8, 16])
    changed = dataclasses.replace(m, **{what: other(rng, getattr(m, what), choices)})
    bad = caches(changed)
    if what == "layers":
        return what, bad, (f"lists {m.layers} layers", f"got {len(bad.arrays)}")
    if what == "block_size":
        return what, bad, (f"hold {changed.block_size} tokens", f"hold {m.block_size}")
    return what, bad, (f"hold {block_bytes(changed)} bytes", f"is {block_bytes(m)}", what)


@pytest.mark.parametrize("seed", range(3))
def test_every_contradicting_property_is_refused_and_the_model_itself_passes(seed):
    rng = np.random.default_rng(1000 + seed)
    print(f"seed={1000 + seed}")
    for _ in range(12):
        m = draw_model(rng)
        cfg = config(m)
        KVOffloader(cfg, caches(m), backend="xla").close()  # the model's own caches pass
        what, bad, names = contradiction(rng, m)
        with pytest.raises(CacheConfigMismatchError) as e:
            KVOffloader(cfg, bad, backend="xla").close()
        message = str(e.value)
        assert all(n in message for n in names), (m, what, message)


@pytest.mark.parametrize(
    ("config_dtype", "arrays", "word"),
    [("bfloat16", "float16", "uint16"), ("float16", "bfloat16", "uint16"),
     ("float8_e4m3fn", "float8_e5m2", "uint8"), ("float32", "int32", "uint32"),
     ("int8", "float8_e4m3fn", "uint8")],
)  # fmt: skip
def test_same_width_dtypes_are_not_the_config_dtype_but_uint_words_are(config_dtype, arrays, word):
    m = Model(2, 8, 4, 2, config_dtype, "nhd")
    with pytest.raises(CacheConfigMismatchError, match=f"arrays are {arrays} .*{config_dtype}"):
        KVOffloader(config(m), caches(m, arrays), backend="xla")
    KVOffloader(config(m), caches(m, word), backend="xla").close()  # a bit container


def test_set_caches_refuses_another_dtype_of_the_same_width():
    m = Model(2, 8, 4, 2, "bfloat16", "nhd")
    with KVOffloader(config(m), caches(m), backend="xla") as off:
        same = off.caches()
        with pytest.raises(CacheConfigMismatchError, match="float16 but the config's"):
            off.set_caches([a.view(jnp.float16) for a in same])
        assert off.caches() == same  # nothing replaced
        off.set_caches([a + 1 for a in same])


def test_a_tp_config_takes_local_and_global_arrays_but_not_more_heads():
    m = Model(4, 8, 4, 2, "bfloat16", "nhd", tp=2)  # 2 heads per worker
    cfg = config(m)
    KVOffloader(cfg, caches(m), backend="xla").close()  # global: all 4 heads
    KVOffloader(cfg, caches(dataclasses.replace(m, heads=2)), backend="xla").close()  # local
    with pytest.raises(CacheConfigMismatchError, match=r"or k x that .* k <= 2 workers"):
        KVOffloader(cfg, caches(dataclasses.replace(m, heads=8)), backend="xla")
    with pytest.raises(CacheConfigMismatchError, match="head_size"):
        KVOffloader(cfg, caches(dataclasses.replace(m, head_size=12)), backend="xla")
