"""The XLA backend against the reference: every layout with every dtype, every n and
array count. Block size and head dim vary with the layout so each value appears."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

from .cases import DTYPES, LAYOUTS, Case, assert_same_bits, block_ids, make_caches, random_bits

_GEOMETRY = {  # layout -> (block_size, head_dim)
    "nhd": (16, 64),
    "hnd": (64, 128),
    "nhd_kv_first": (16, 128),
    "hnd_kv_second": (16, 64),
    "nhd_kv_separate": (64, 64),
    "mla": (16, 576),
    "raw": (16, 64),
}


def _cases():
    # Full product of layout x dtype; n and the array count rotate through their values
    # (an n x array-count product follows for one layout): the full 4-axis product took
    # 128 s on the 2-core CI machine, almost all of it XLA compiles.
    pairs = [
        (layout, dtype)
        for layout, dtype in itertools.product(LAYOUTS, DTYPES)
        if layout != "raw" or dtype in ("uint8", "int8")  # raw pages hold integer words
    ]
    for k, (layout, dtype) in enumerate(pairs):
        n = (0, 1, 7, 64)[k % 4]
        num_arrays = 4 if layout == "nhd_kv_separate" else (1, 4)[(k // 4) % 2]
        bs, d = _GEOMETRY[layout]
        yield Case(layout, dtype, num_arrays, bs, d, n)
    for num_arrays, n in itertools.product((1, 4), (0, 1, 7, 64)):
        yield Case("nhd_kv_first", "bf16", num_arrays, 16, 128, n)


CASES = list(_cases())


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_xla_matches_reference(case):
    layout = LAYOUTS[case.layout]
    caches = make_caches(case)
    ids = block_ids(case.n)

    staged = pk.gather_blocks(caches, ids, layout=layout, backend="xla")
    expected = pk.gather_blocks(caches, ids, layout=layout, backend="reference")
    assert staged.shape == (case.n, case.num_arrays, *layout.page_shape(case.shape()))
    assert_same_bits(staged, expected)

    update = random_bits(staged.shape, staged.dtype, seed=99)
    expected_caches = pk.scatter_blocks_reference(caches, jnp.asarray(ids), update, layout=layout)
    keep = [np.asarray(c).copy() for c in caches]
    out = pk.scatter_blocks(caches, ids, update, layout=layout, backend="xla")
    for got, want in zip(out, expected_caches, strict=True):
        assert_same_bits(got, want)
    if case.n == 0:
        for got, before in zip(out, keep, strict=True):
            assert_same_bits(got, before)


def test_reference_gather_is_block_major_and_bit_exact():
    """Entry i is every array's page of ids[i], in array order, straight from numpy."""
    case = Case("nhd_kv_first", "bf16", 4, 16, 64, 7)
    caches = make_caches(case)
    ids = block_ids(7)
    staged = pk.gather_blocks(caches, ids, layout=LAYOUTS[case.layout], backend="reference")
    for i, b in enumerate(ids):
        for a, cache in enumerate(caches):
            assert_same_bits(staged[i, a], np.asarray(cache)[:, b])


def test_reference_scatter_touches_only_named_pages():
    case = Case("mla", "fp8_e5m2", 1, 16, 576, 7)
    (cache,) = make_caches(case)
    ids = block_ids(7)
    update = random_bits((7, 1, 16, 576), DTYPES["fp8_e5m2"], seed=5)
    (out,) = pk.scatter_blocks_reference(
        [cache], jnp.asarray(ids), update, layout=pk.KVLayout.mla()
    )
    want = np.asarray(cache).copy()
    want[ids] = np.asarray(update)[:, 0]
    assert_same_bits(out, want)


def test_scatter_donates_and_reuses_the_cache_buffer():
    """In place: the XLA path aliases the donated cache, so the input is consumed."""
    case = Case("nhd", "bf16", 1, 16, 64, 7)
    (cache,) = make_caches(case)
    ids = block_ids(7)
    update = random_bits((7, 1, 16, 1, 64), jnp.bfloat16, seed=3)
    (out,) = pk.scatter_blocks([cache], ids, update, layout=pk.KVLayout.nhd(), backend="xla")
    assert cache.is_deleted()
    assert not out.is_deleted()
