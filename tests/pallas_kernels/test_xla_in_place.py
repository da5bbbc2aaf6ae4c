"""The XLA backend's scatter writes the donated caches where they lie: in the compiled
program a call runs, no step besides the scatter itself produces a whole cache.

Before: every scatter went through ``[outer, num_blocks, words]`` integer views. For an
fp32 or integer cache with a size-1 axis (the fp32 RPA cache's packing axis, one KV
head per device) XLA:CPU's layout assignment laid the view's way back out with that axis
outermost and added a copy of every cache per call, and any fp32 cache paid a bitcast
copy into a new buffer and back: three passes over each cache for the fp32 RPA cache,
two for fp32 NHD, where the RPA vs NHD target (issue 19) needs them equal. Now caches of
a bit-keeping type are scattered in their own type and shape: no pass at all. bf16 keeps
its fence (two passes, ``layout.fenced``) on both layouts alike.

The count is the one ``benchmarks/kernels_rpa.py`` prints ("scatter passes").
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

ROOT = Path(__file__).resolve().parents[2]
LAYERS = 3


def _benchmark():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    path = ROOT / "benchmarks" / "kernels_rpa.py"
    spec = importlib.util.spec_from_file_location("_kernels_rpa", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


BENCH = _benchmark()


def _caches(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    raw = rng.integers(0, 256, (LAYERS, int(np.prod(shape)) * dt.itemsize), dtype=np.uint8)
    return [jnp.asarray(r.view(dt).reshape(shape)) for r in raw]


def _passes(layout, shape, dtype):
    caches = _caches(shape, dtype)
    ids = np.array([5, 0, 3], np.int32)
    staging = pk.gather_blocks(caches, ids, layout=layout, backend="xla")
    return BENCH.passes("xla", layout, caches, ids, staging)


# (layout, cache shape, dtype): each has a size-1 axis except the plain NHD ones
IN_PLACE = [
    ("rpa", pk.rpa_cache_shape(8, 16, 8, 128, jnp.float32), jnp.float32),
    ("rpa", pk.rpa_cache_shape(8, 16, 2, 128, jnp.int32), jnp.int32),
    ("rpa", pk.rpa_cache_shape(8, 16, 4, 128, jnp.int8), jnp.int8),
    ("nhd", (8, 16, 1, 64), jnp.float32),
    ("nhd", (8, 16, 4, 64), jnp.float32),
    ("nhd_first", (2, 8, 16, 1, 64), jnp.uint8),
    ("hnd_second", (8, 2, 1, 16, 64), jnp.uint16),
    ("mla", (8, 16, 576), jnp.float32),
]


@pytest.mark.parametrize(("name", "shape", "dtype"), IN_PLACE, ids=lambda v: str(v))
def test_bit_keeping_caches_are_scattered_without_a_pass_over_them(name, shape, dtype):
    assert _passes(pk.named_layout(name), shape, dtype)[1] == 0


def test_fenced_bf16_caches_pay_the_same_passes_on_rpa_and_nhd():
    rpa_shape = pk.rpa_cache_shape(8, 16, 8, 128, jnp.bfloat16)
    nhd_shape = (8, 16, rpa_shape[2] * rpa_shape[3], 128)
    rpa = _passes(pk.KVLayout.rpa(), rpa_shape, jnp.bfloat16)
    nhd = _passes(pk.KVLayout.nhd(), nhd_shape, jnp.bfloat16)
    assert rpa == nhd == (0, 2 * LAYERS)  # gather none; scatter: fence in, bits out


def test_the_count_sees_a_copy_of_a_cache():
    """The counter itself: a step that writes a whole cache counts, one of a page not."""
    import jax

    cache = jnp.zeros((8, 16, 1, 64), jnp.float32)
    text = jax.jit(lambda c: (c + 1.0, c[2] * 2.0)).lower(cache).compile().as_text()
    assert BENCH.cache_passes(text, cache.nbytes) == 1
    text = jax.jit(lambda c: c[2] * 2.0).lower(cache).compile().as_text()
    assert BENCH.cache_passes(text, cache.nbytes) == 0


def test_native_scatter_moves_every_bit_and_leaves_other_pages():
    """fp32 and int caches now go through XLA's scatter in their own type: NaN payloads,
    signalling NaNs, -0.0 and subnormals land as they were; untouched pages keep theirs."""
    special = np.array([0x7FA00001, 0xFF800001, 0x80000000, 0x00000001, 0x807FFFFF], np.uint32)
    for name, shape, dtype in IN_PLACE:
        layout = pk.named_layout(name)
        caches = _caches(shape, dtype, seed=1)
        before = [np.asarray(c).view(np.uint8).copy() for c in caches]
        ids = np.array([6, 1], np.int32)
        page = layout.page_shape(tuple(shape))
        itemsize = np.dtype(dtype).itemsize
        words = np.resize(special, (2 * LAYERS * int(np.prod(page)) * itemsize) // 4)
        staging = jnp.asarray(words.view(np.dtype(dtype)).reshape(2, LAYERS, *page))
        want = np.asarray(staging).view(np.uint8)
        out = pk.scatter_blocks(caches, ids, staging, layout=layout, backend="xla")
        axis = layout.block_axis
        for layer, (o, b) in enumerate(zip(out, before, strict=True)):
            got = np.moveaxis(np.asarray(o).view(np.uint8), axis, 0)
            old = np.moveaxis(b, axis, 0)
            for i, block in enumerate(ids):
                assert (got[block] == want[i, layer]).all(), (name, layer, block)
            rest = np.setdiff1d(np.arange(got.shape[0]), ids)
            assert (got[rest] == old[rest]).all(), (name, layer)
