"""The ragged-paged-attention v3 layout: names, geometry, packing, gather/scatter bits.

Sharded caches (1-8 devices, tpu-inference's ``P("data", None, "model")``) are covered
by test_bits_sharded.py, which draws RPA cases with every other layout.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload.config import CACHE_LAYOUTS

from .bitmodel import DTYPES, bits_of, model_gather, model_scatter, random_bits

RPA_DTYPES = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8")


def test_every_layout_has_a_name_and_back():
    for name in pk.LAYOUT_NAMES:
        assert pk.named_layout(name).name == name
        assert pk.named_layout(name.upper()) == pk.named_layout(name)
    assert pk.named_layout("rpa") == pk.KVLayout.rpa()
    assert pk.named_layout("nhd_second") == pk.KVLayout.nhd(pk.KVStacking.SECOND)
    assert len(set(pk.LAYOUT_NAMES)) == len(pk.LAYOUT_NAMES) == 11
    with pytest.raises(pk.LayoutError, match="'rpa'"):
        pk.named_layout("ragged")


def test_config_knows_the_same_names():
    # config imports nothing of ours: it keeps a copy of the names, kept equal here.
    assert sorted(CACHE_LAYOUTS) == sorted(pk.LAYOUT_NAMES)


def test_rpa_takes_no_kv_stacking():
    with pytest.raises(pk.LayoutError, match="K and V alternate"):
        pk.KVLayout(page_format=pk.PageFormat.RPA, kv_stacking=pk.KVStacking.SECOND)


@pytest.mark.parametrize(
    ("dtype", "heads", "shards", "rows", "packing"),
    [
        (jnp.bfloat16, 8, 1, 8, 2),
        (jnp.bfloat16, 8, 4, 8, 2),
        (jnp.float32, 3, 1, 6, 1),
        (jnp.float8_e4m3fn, 4, 1, 2, 4),
        (jnp.float8_e4m3fn, 4, 4, 4, 4),  # each shard: 2 real slots in 4: half padding
        (jnp.int8, 1, 1, 1, 4),
        (jnp.float8_e5m2, 6, 2, 4, 4),
    ],
)
def test_cache_shape_is_the_formula(dtype, heads, shards, rows, packing):
    # S * align(2H / S, packing) // packing rows, head_dim padded to 128.
    shape = pk.rpa_cache_shape(10, 16, heads, 64, dtype, shards=shards)
    assert shape == (10, 16, rows, packing, 128)
    assert pk.rpa_cache_shape(1, 1, heads, 129, dtype, shards=shards)[4] == 256
    pk.KVLayout.rpa().check_cache(shape, np.dtype(dtype), name="c")


def test_geometry_is_refused_with_typed_errors():
    lay = pk.KVLayout.rpa()
    with pytest.raises(pk.LayoutMismatchError, match="packing"):
        lay.check_cache((4, 16, 4, 2, 128), np.dtype(jnp.float8_e4m3fn), name="c")
    with pytest.raises(pk.LayoutMismatchError, match="multiple of 128"):
        lay.check_cache((4, 16, 4, 2, 64), np.dtype(jnp.bfloat16), name="c")
    with pytest.raises(pk.LayoutMismatchError, match="rank 5"):
        lay.check_cache((4, 16, 4, 128), np.dtype(jnp.bfloat16), name="c")
    with pytest.raises(pk.LayoutError, match="divide"):
        pk.rpa_cache_shape(4, 16, 6, 128, jnp.bfloat16, shards=4)
    with pytest.raises(pk.LayoutMismatchError, match="head_dim-64"):
        # tpu-inference's head_dim-64 kernel: K and V of a head in one 128-lane row
        pk.check_rpa_geometry((4, 16, 2, 2, 128), jnp.bfloat16, 4, 1)


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_pack_puts_k_and_v_in_alternating_slots(shards):
    rng = np.random.default_rng(shards)
    k = rng.integers(0, 256, (3, 2, 4, 5), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    v = rng.integers(0, 256, (3, 2, 4, 5), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    cache = pk.rpa_pack(k, v, shards=shards)
    assert cache.shape == pk.rpa_cache_shape(3, 2, 4, 5, k.dtype, shards=shards)
    real, padded = pk.rpa_slots_per_shard(4, k.dtype, shards)
    slots = cache.view(np.uint8).reshape(3, 2, shards, padded, 128)
    for h in range(4):  # slot 2h of the whole cache is K of head h, 2h + 1 its V
        s, j = divmod(2 * h, real)
        assert np.array_equal(slots[:, :, s, j, :5], k.view(np.uint8)[:, :, h])
        assert np.array_equal(slots[:, :, s, j + 1, :5], v.view(np.uint8)[:, :, h])
    assert not slots[..., real:, :].any() and not slots[..., 5:].any()  # zero padding
    k2, v2 = pk.rpa_unpack(cache, 4, 5, shards=shards)
    assert np.array_equal(k2.view(np.uint8), k.view(np.uint8))
    assert np.array_equal(v2.view(np.uint8), v.view(np.uint8))


@pytest.mark.parametrize("backend", ["xla", "reference"])
@pytest.mark.parametrize("dtype", RPA_DTYPES)
def test_gather_and_scatter_move_every_bit(backend, dtype):
    """Special patterns (NaN payloads, -0.0, subnormals) in every slot, padding too."""
    rng = np.random.default_rng(7)
    shape = pk.rpa_cache_shape(5, 3, 3, 128, DTYPES[dtype])
    caches = [random_bits(rng, shape, dtype) for _ in range(3)]
    kw = {"layout": pk.KVLayout.rpa(), "backend": backend}
    ids = np.array([4, 0, 4, 2], np.int32)
    arrays = [jnp.asarray(c.view(DTYPES[dtype])) for c in caches]
    staged = pk.gather_blocks(arrays, ids, **kw)
    assert staged.shape == (4, 3, *shape[1:])
    assert np.array_equal(bits_of(staged), model_gather(caches, ids, 0))
    scatter = np.array([3, 1], np.int32)
    update = random_bits(rng, (2, 3, *shape[1:]), dtype)
    out = pk.scatter_blocks(arrays, scatter, jnp.asarray(update.view(DTYPES[dtype])), **kw)
    for o, e in zip(out, model_scatter(caches, scatter, update, 0), strict=True):
        assert np.array_equal(bits_of(o), e)  # pages 0, 2, 4 kept too


def test_rpa_staging_is_their_chunk():
    """Entry i of our staging is tpu-inference's chunk (1, layers, bs, rows, packing, D)."""
    rng = np.random.default_rng(3)
    shape = pk.rpa_cache_shape(6, 4, 2, 128, jnp.bfloat16)
    caches = [random_bits(rng, shape, "bf16").view(ml_dtypes.bfloat16) for _ in range(2)]
    staged = np.asarray(pk.gather_blocks([jnp.asarray(c) for c in caches], np.array([5], np.int32),
                                         layout=pk.named_layout("rpa")))  # fmt: skip
    chunk = np.stack([c[5] for c in caches])[None]  # their stack_kv_cache_cross_layers
    assert staged.shape == chunk.shape
    assert np.array_equal(staged.view(np.uint16), chunk.view(np.uint16))


@pytest.mark.parametrize("dtype", [jnp.int4, jnp.uint4, jnp.float4_e2m1fn])
def test_sub_byte_dtypes_are_refused(dtype):
    """numpy keeps int4/fp4 one per byte, an engine 8 per word (32 // 4): the packing
    axis and page bytes would not be theirs (accepted with packing 4 before)."""
    with pytest.raises(pk.UnsupportedDtypeError, match="4 bits"):
        pk.rpa_packing(dtype)
    with pytest.raises(pk.UnsupportedDtypeError, match="4 bits"):
        pk.rpa_cache_shape(2, 4, 2, 64, dtype)
    with pytest.raises(pk.UnsupportedDtypeError, match="4 bits"):
        pk.KVLayout.rpa().check_cache((2, 4, 1, 4, 128), np.dtype(dtype), name="c")


def test_pack_and_unpack_refuse_inputs_they_would_misread():
    k = np.zeros((2, 4, 3, 64), ml_dtypes.float8_e4m3fn)
    with pytest.raises(pk.LayoutMismatchError, match="one dtype"):  # packed V as fp8 before
        pk.rpa_pack(k, k.view(np.int8))
    with pytest.raises(pk.LayoutMismatchError, match="one shape"):
        pk.rpa_pack(k, k[:, :, :2])
    with pytest.raises(pk.LayoutMismatchError, match="one shape"):
        pk.rpa_pack(k[0], k[0])
    cache = pk.rpa_pack(k, k)
    with pytest.raises(pk.LayoutError, match="head_dim"):  # 127 lanes came back before
        pk.rpa_unpack(cache, 3, -1)
    with pytest.raises(pk.LayoutMismatchError, match="wider"):
        pk.rpa_unpack(cache, 3, 200)
    with pytest.raises(pk.LayoutMismatchError, match="got shape"):
        pk.rpa_unpack(cache[0], 3, 64)


def test_merge_canonical_refuses_pages_of_other_heads():
    # Before: a bare TypeError from a reshape (canonical pages sized for the heads
    # passed, RPA pages for others).
    into = jnp.zeros(pk.rpa_cache_shape(3, 4, 2, 128, jnp.bfloat16), jnp.bfloat16)
    with pytest.raises(pk.LayoutMismatchError, match="for 4 KV heads"):
        pk.rpa_merge_canonical(into, jnp.zeros((3, 4, 8, 128), jnp.bfloat16), 4, 1)
