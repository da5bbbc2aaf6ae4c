"""Every public entry refuses bad input itself: a ``TypeError`` (wrong type) or a
``ValueError`` (wrong value), the package's own class where one exists, raised inside
``pallas_kernels`` (never a jax traceback), with a message naming the parameter.

Inputs come from outside the library's own constructors: plain lists, None, numpy
arrays of the wrong kind, deleted arrays, ShapeDtypeStructs, strings for enums.
"""

from __future__ import annotations

import pathlib
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

PKG = pathlib.Path(pk.__file__).resolve().parent
NHD = pk.KVLayout.nhd()
IDS = np.array([1, 2], np.int32)


def _cache(shape=(8, 4, 1, 8), dtype=jnp.bfloat16):
    return jnp.zeros(shape, dtype)


def _deleted():
    x = _cache()
    jax.jit(lambda a: a, donate_argnums=0)(x)
    return x


def _gather(**kw):
    args = {"caches": [_cache()], "block_ids": IDS, "layout": NHD, "backend": "xla", **kw}
    return lambda: pk.gather_blocks(args.pop("caches"), args.pop("block_ids"), **args)


def _scatter(**kw):
    args = {"caches": [_cache()], "block_ids": IDS, "layout": NHD, "backend": "xla"}
    args["staging"] = jnp.zeros((2, 1, 4, 1, 8), jnp.bfloat16)
    args.update(kw)
    c, i, s = args.pop("caches"), args.pop("block_ids"), args.pop("staging")
    return lambda: pk.scatter_blocks(c, i, s, **args)


# (id, call, expected type, a word the message must contain)
BAD = [
    ("caches-none", _gather(caches=None), TypeError, "caches"),
    ("caches-array", _gather(caches=_cache()), TypeError, "caches"),
    ("caches-empty", _gather(caches=[]), pk.CacheError, "caches"),
    ("caches-ints", _gather(caches=[1, 2]), TypeError, "caches[0]"),
    ("caches-sds", _gather(caches=[jax.ShapeDtypeStruct((8, 4, 1, 8), jnp.bfloat16)]),
     TypeError, "caches[0]"),
    ("caches-deleted", _gather(caches=[_deleted()]), pk.CacheError, "scatter_blocks"),
    ("caches-mixed-dtype", _gather(caches=[_cache(), _cache(dtype=jnp.float16)]),
     pk.LayerMismatchError, "caches[1]"),
    ("caches-rank", _gather(caches=[_cache((8, 4, 8))]), pk.LayoutMismatchError, "rank"),
    ("caches-empty-page", _gather(caches=[_cache((8, 4, 0, 8))]),
     pk.LayoutMismatchError, "no element"),
    ("caches-int64", _gather(caches=[np.zeros((8, 4, 1, 8), np.int64)]),
     pk.UnsupportedDtypeError, "int64"),
    ("caches-float64", _gather(caches=[np.zeros((8, 4, 1, 8), np.float64)]),
     pk.UnsupportedDtypeError, "float64"),
    ("caches-bool", _gather(caches=[_cache(dtype=jnp.bool_)]), pk.UnsupportedDtypeError, "bool"),
    ("raw-float", _gather(caches=[_cache((8, 32))], layout=pk.KVLayout.raw()),
     pk.UnsupportedDtypeError, "RAW"),
    ("first-not-2", _gather(caches=[_cache((3, 8, 4, 1, 8))],
                            layout=pk.KVLayout.nhd(pk.KVStacking.FIRST)),
     pk.LayoutMismatchError, "axis 0"),
    ("separate-odd", _gather(caches=[_cache()], layout=pk.KVLayout.nhd(pk.KVStacking.SEPARATE)),
     pk.LayoutMismatchError, "even"),
    ("ids-none", _gather(block_ids=None), TypeError, "block_ids"),
    ("ids-list", _gather(block_ids=[1, 2]), TypeError, "block_ids"),
    ("ids-float", _gather(block_ids=np.array([1.0])), pk.BlockIdsDtypeError, "block_ids"),
    ("ids-int64", _gather(block_ids=np.array([1])), pk.BlockIdsDtypeError, "int32"),
    ("ids-bool", _gather(block_ids=np.array([True])), pk.BlockIdsDtypeError, "int32"),
    ("ids-2d", _gather(block_ids=IDS[None]), pk.BlockIdsError, "1-D"),
    ("ids-scalar", _gather(block_ids=np.int32(1)), TypeError, "block_ids"),
    ("ids-0d", _gather(block_ids=np.array(1, np.int32)), pk.BlockIdsError, "1-D"),
    ("ids-high", _gather(block_ids=np.array([8], np.int32)), pk.BlockIdsOutOfRangeError, "[0, 8)"),
    ("ids-negative", _gather(block_ids=np.array([-1], np.int32)),
     pk.BlockIdsOutOfRangeError, "-1"),
    ("layout-none", _gather(layout=None), TypeError, "layout"),
    ("layout-str", _gather(layout="NHD"), TypeError, "layout"),
    ("layout-class", _gather(layout=pk.KVLayout), TypeError, "layout"),
    ("backend-none", _gather(backend=None), TypeError, "backend"),
    ("backend-int", _gather(backend=3), TypeError, "backend"),
    ("backend-unknown", _gather(backend="cuda"), pk.BackendUnavailableError, "backend"),
    ("backend-case", _gather(backend="XLA"), pk.BackendUnavailableError, "backend"),
    ("backend-triton-cpu", _gather(backend="triton"), pk.BackendUnavailableError, "interpret"),
    ("backend-tpu-cpu", _gather(backend="tpu"), pk.BackendUnavailableError, "interpret"),
    ("backend-mosaic-cpu", _gather(backend="mosaic_gpu"), pk.BackendUnavailableError, "cpu"),
    ("backend-triton-numpy", _gather(caches=[np.zeros((8, 4, 1, 8), np.uint16)], backend="triton"),
     pk.BackendUnavailableError, "interpret"),
    ("config-wrong", _gather(config=pk.TpuConfig()), TypeError, "XlaConfig"),
    ("config-object", _gather(config=object()), TypeError, "config"),
    ("config-reference", _gather(backend="reference", config=pk.XlaConfig()), TypeError,
     "config"),
    ("config-word-bytes", _gather(caches=[_cache((8, 3), jnp.uint8)], layout=pk.KVLayout.raw(),
                                  config=pk.XlaConfig(word_bytes=2)),
     pk.BackendConfigError, "word_bytes"),
    ("interpret-str", _gather(backend="triton", interpret="yes"), TypeError, "interpret"),
    ("interpret-int", _gather(backend="tpu", interpret=1), TypeError, "interpret"),
    ("interpret-str-xla", _gather(interpret="yes"), TypeError, "interpret"),
    ("staging-none", _scatter(staging=None), TypeError, "staging"),
    ("staging-list", _scatter(staging=[[0]]), TypeError, "staging"),
    ("staging-sds", _scatter(staging=jax.ShapeDtypeStruct((2, 1, 4, 1, 8), jnp.bfloat16)),
     TypeError, "staging"),
    ("staging-shape", _scatter(staging=jnp.zeros((2, 4, 1, 8), jnp.bfloat16)),
     pk.StagingMismatchError, "staging"),
    ("staging-dtype", _scatter(staging=jnp.zeros((2, 1, 4, 1, 8), jnp.float16)),
     pk.StagingMismatchError, "dtype"),
    ("scatter-duplicate", _scatter(block_ids=np.array([1, 1], np.int32)),
     pk.DuplicateBlockIdsError, "unique"),
    ("scatter-triton-cpu", _scatter(backend="triton"), pk.BackendUnavailableError, "triton"),
    ("check-num-blocks-str", lambda: pk.check_block_ids(IDS, "8", unique=False), TypeError,
     "num_blocks"),
    ("check-num-blocks-neg", lambda: pk.check_block_ids(IDS, -1, unique=False), ValueError,
     "num_blocks"),
    ("check-unique-str", lambda: pk.check_block_ids(IDS, 8, unique="yes"), TypeError, "unique"),
    ("sharding-none", lambda: pk.staging_sharding(None, NHD), TypeError, "caches"),
    ("sharding-layout", lambda: pk.staging_sharding([_cache()], "NHD"), TypeError, "layout"),
    ("reference-ids", lambda: pk.gather_blocks_reference([_cache()], [1], layout=NHD), TypeError,
     "block_ids"),
    ("reference-staging", lambda: pk.scatter_blocks_reference([_cache()], IDS, None, layout=NHD),
     TypeError, "staging"),
    ("get-backend-int", lambda: pk.get_backend(1), TypeError, "backend"),
    ("get-backend-auto", lambda: pk.get_backend("auto"), pk.BackendUnavailableError, "backend"),
    ("supported-where", lambda: pk.supported_backends(where=3), TypeError, "where"),
    ("layout-stacking-str", lambda: pk.KVLayout.nhd("first"), TypeError, "kv_stacking"),
    ("layout-mla-first", lambda: pk.KVLayout(page_format=pk.PageFormat.MLA,
                                             kv_stacking=pk.KVStacking.FIRST),
     pk.LayoutError, "kv_stacking"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "call", "kind", "word"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_gives_a_typed_error_from_the_package(name, call, kind, word):
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    exc = info.value
    assert isinstance(exc, kind), f"{name}: {type(exc).__name__}: {exc}"
    assert word in str(exc), f"{name}: {word!r} not in {exc}"
    # Raised by our own checks, not from inside jax.
    last = traceback.extract_tb(exc.__traceback__)[-1]
    assert pathlib.Path(last.filename).resolve().is_relative_to(PKG), (name, last)
    if isinstance(exc, ValueError):
        assert isinstance(exc, pk.PallasKernelsError), f"{name}: {type(exc).__mro__}"
