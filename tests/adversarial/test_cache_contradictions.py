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


# RPA v3 caches (tpu-inference's) are padded: the combined head axis to the packing
# (`align(2 * heads, packing) // packing` rows, packing = 32 // dtype bits) and the head
# size to 128 lanes, so their bytes do not state the heads. The old check skipped them:
# any RPA array passed under any config.
RPA_DTYPES = ["bfloat16", "float8_e4m3fn", "int8", "float32"]
RPA_HEADS = [1, 2, 3, 4, 6, 8]
RPA_SIZES = [64, 96, 128, 200, 256]
RPA = pk.KVLayout.rpa()


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name, None) or name)


def rpa_caches(m: Model, heads: int, head_size: int) -> GroupCaches:
    shape = pk.rpa_cache_shape(NB, m.block_size, heads, head_size, _np_dtype(m.dtype))
    return GroupCaches([jnp.zeros(shape, _np_dtype(m.dtype)) for _ in range(m.layers)], RPA)


def rpa_admits(m: Model, shape: tuple[int, ...], model_heads: int | None) -> bool:
    """The oracle, forwards from the model to the arrays: the config states heads x head
    size (its bytes); arrays pass iff some (heads, head size) of that product (heads the
    model's, when given) has exactly their padded shape, by `pk.rpa_cache_shape` or, at
    head size 64, tpu-inference's hd64 rows (K and V of a head in one 128-lane row).
    Without the model's heads, arrays whose padded bytes are the config's pass too."""
    dt, product = _np_dtype(m.dtype), m.heads * m.head_size
    packing = 4 // dt.itemsize
    for h in [model_heads] if model_heads else range(1, product + 1):
        if product % h:
            continue
        d = product // h
        if pk.rpa_cache_shape(NB, m.block_size, h, d, dt) == shape:
            return True
        if d == 64 and (NB, m.block_size, -(-h // packing), packing, 128) == shape:
            return True
    padded = int(np.prod(shape[1:])) * dt.itemsize * m.layers
    return model_heads is None and padded == block_bytes(m)


@pytest.mark.parametrize("seed", range(2))
def test_rpa_caches_pass_exactly_when_their_padded_shape_is_the_configs(seed):
    rng = np.random.default_rng(2000 + seed)
    print(f"seed={2000 + seed}")
    refused = 0
    for _ in range(16):
        m = Model(
            heads=int(rng.choice(RPA_HEADS)),
            head_size=int(rng.choice(RPA_SIZES)),
            block_size=int(rng.choice([2, 4])),
            layers=int(rng.integers(1, 3)),
            dtype=str(rng.choice(RPA_DTYPES)),
            layout="rpa",
        )
        cfg = config(m)
        heads, size = int(rng.choice(RPA_HEADS)), int(rng.choice(RPA_SIZES))
        shape = tuple(rpa_caches(m, heads, size).arrays[0].shape)
        for model_heads in (None, m.heads):
            kw = {} if model_heads is None else {"total_kv_heads": model_heads}
            KVOffloader(cfg, rpa_caches(m, m.heads, m.head_size), backend="xla", **kw).close()
            if rpa_admits(m, shape, model_heads):
                KVOffloader(cfg, rpa_caches(m, heads, size), backend="xla", **kw).close()
                continue
            refused += 1
            with pytest.raises(CacheConfigMismatchError) as e:
                KVOffloader(cfg, rpa_caches(m, heads, size), backend="xla", **kw)
            message = str(e.value)
            assert str(shape) in message and "rpa_cache_shape" in message, (m, message)
    assert refused  # the draws do contradict


@pytest.mark.parametrize("dtype", RPA_DTYPES)
def test_rpa_caches_of_other_heads_or_head_size_are_refused_naming_both_shapes(dtype):
    m = Model(2, 128, 4, 2, dtype, "rpa")
    cfg, dt = config(m), _np_dtype(dtype)
    own = tuple(pk.rpa_cache_shape(NB, 4, 2, 128, dt))
    KVOffloader(cfg, rpa_caches(m, 2, 128), backend="xla", total_kv_heads=2).close()
    for heads, size in ((8, 128), (2, 256), (1, 128)):
        bad = tuple(pk.rpa_cache_shape(NB, 4, heads, size, dt))
        if bad == own:  # fp8, int8: 1 head's 2 slots are padded to 4, as 2 heads' 4 are
            KVOffloader(cfg, rpa_caches(m, heads, size), backend="xla", total_kv_heads=2).close()
            continue
        with pytest.raises(CacheConfigMismatchError) as e:
            KVOffloader(cfg, rpa_caches(m, heads, size), backend="xla", total_kv_heads=2)
        assert str(bad) in str(e.value) and str(own) in str(e.value), str(e.value)
    # Without the model's heads the bytes alone decide (`rpa_admits`): 4 heads of 64
    # have the bytes of 2 heads of 128 and the shape of 4 heads of 128; 2 heads of 256
    # pass only where 1 head of 256 has their shape (fp8, int8: both pad to one row).
    assert rpa_admits(m, tuple(pk.rpa_cache_shape(NB, 4, 4, 128, dt)), None)
    KVOffloader(cfg, rpa_caches(m, 4, 128), backend="xla").close()
    if rpa_admits(m, tuple(pk.rpa_cache_shape(NB, 4, 2, 256, dt)), None):
        assert dt.itemsize == 1
        KVOffloader(cfg, rpa_caches(m, 2, 256), backend="xla").close()
    else:
        with pytest.raises(CacheConfigMismatchError):
            KVOffloader(cfg, rpa_caches(m, 2, 256), backend="xla")
