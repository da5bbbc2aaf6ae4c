"""Bad input: each rule gives its typed error, and the message names, states, shows, fixes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

from .cases import Case, assert_same_bits, make_caches

NHD = pk.KVLayout.nhd()


@pytest.fixture
def caches():
    return make_caches(Case("nhd", "bf16", 2, 16, 64, 0))


def _staging(n, num_arrays=2, dtype=jnp.bfloat16):
    return jnp.zeros((n, num_arrays, 16, 1, 64), dtype)


@pytest.mark.parametrize("bad", [[-1], [67], [3, 99, 5]])
def test_out_of_range_ids_are_refused_not_clamped(caches, bad):
    ids = np.array(bad, np.int32)
    with pytest.raises(pk.BlockIdsOutOfRangeError, match=r"block_ids must lie in \[0, 67\)"):
        pk.gather_blocks(caches, ids, layout=NHD, backend="xla")
    with pytest.raises(pk.BlockIdsOutOfRangeError, match=str(bad[-1] if bad[-1] != 5 else 99)):
        pk.scatter_blocks(caches, ids, _staging(len(bad)), layout=NHD, backend="xla")


def test_out_of_range_error_is_a_value_error(caches):
    with pytest.raises(ValueError, match="drop them or fix the block table"):
        pk.gather_blocks(caches, np.array([70], np.int32), layout=NHD, backend="reference")


def test_duplicate_scatter_ids_are_refused(caches):
    ids = np.array([4, 9, 4], np.int32)
    with pytest.raises(pk.DuplicateBlockIdsError, match=r"must be unique.*repeated ids \[4\]"):
        pk.scatter_blocks(caches, ids, _staging(3), layout=NHD, backend="xla")


def test_duplicate_gather_ids_are_fine(caches):
    staged = pk.gather_blocks(caches, np.array([4, 4], np.int32), layout=NHD, backend="xla")
    assert_same_bits(staged[0], staged[1])


@pytest.mark.parametrize("dtype", [np.int64, np.uint32, np.float32, np.int16])
def test_ids_must_be_int32(caches, dtype):
    with pytest.raises(pk.BlockIdsDtypeError, match=r"dtype int32, got .*astype\(np.int32\)"):
        pk.gather_blocks(caches, np.array([1, 2], dtype), layout=NHD, backend="xla")


def test_ids_must_be_an_array_and_1d(caches):
    with pytest.raises(TypeError, match="block_ids must be an int32 array, got list"):
        pk.gather_blocks(caches, [1, 2], layout=NHD, backend="xla")
    with pytest.raises(pk.BlockIdsError, match=r"1-D, got shape \(1, 2\)"):
        pk.gather_blocks(caches, np.array([[1, 2]], np.int32), layout=NHD, backend="xla")


def test_layers_must_agree_in_shape(caches):
    other = jnp.zeros((67, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(pk.LayerMismatchError, match=r"caches\[2\] is bfloat16\[67, 16, 2, 64\]"):
        pk.gather_blocks([*caches, other], np.array([1], np.int32), layout=NHD, backend="xla")


def test_layers_must_agree_in_dtype(caches):
    other = jnp.zeros((67, 16, 1, 64), jnp.float16)
    with pytest.raises(pk.LayerMismatchError, match="share shape and dtype"):
        pk.gather_blocks([caches[0], other], np.array([1], np.int32), layout=NHD, backend="xla")


def test_layout_rank_must_match(caches):
    with pytest.raises(pk.LayoutMismatchError, match=r"needs rank 5: \[2, num_blocks"):
        pk.gather_blocks(
            caches,
            np.array([1], np.int32),
            layout=pk.KVLayout.nhd(pk.KVStacking.FIRST),
            backend="xla",
        )


def test_kv_first_needs_a_leading_two():
    cache = jnp.zeros((3, 8, 16, 1, 64), jnp.bfloat16)
    with pytest.raises(pk.LayoutMismatchError, match="axis 0 of size 2"):
        pk.gather_blocks(
            [cache], np.array([1], np.int32), layout=pk.KVLayout.nhd(pk.KVStacking.FIRST)
        )


@pytest.mark.parametrize("dtype", [jnp.bool_, jnp.complex64])
def test_unsupported_cache_dtypes(dtype):
    cache = jnp.zeros((8, 16, 1, 64), dtype)
    with pytest.raises(pk.UnsupportedDtypeError, match=r"KVLayout\.raw"):
        pk.gather_blocks([cache], np.array([1], np.int32), layout=NHD, backend="xla")


def test_raw_layout_needs_integer_words():
    cache = jnp.zeros((8, 1024), jnp.float16)
    with pytest.raises(pk.UnsupportedDtypeError, match="bitcast_convert_type"):
        pk.gather_blocks([cache], np.array([1], np.int32), layout=pk.KVLayout.raw())


def test_staging_shape_and_dtype(caches):
    ids = np.array([1, 2], np.int32)
    with pytest.raises(pk.StagingMismatchError, match=r"shape \[n, num_arrays, \*page\]"):
        pk.scatter_blocks(caches, ids, _staging(3), layout=NHD, backend="xla")
    with pytest.raises(pk.StagingMismatchError, match=r"caches' dtype bfloat16, got float16"):
        pk.scatter_blocks(caches, ids, _staging(2, dtype=jnp.float16), layout=NHD, backend="xla")


def test_caches_must_be_a_sequence(caches):
    with pytest.raises(TypeError, match=r"wrap a single array as \[cache\]"):
        pk.gather_blocks(caches[0], np.array([1], np.int32), layout=NHD)
    with pytest.raises(ValueError, match="at least one array"):
        pk.gather_blocks([], np.array([1], np.int32), layout=NHD)


def test_kv_separate_needs_pairs(caches):
    layout = pk.KVLayout.nhd(pk.KVStacking.SEPARATE)
    with pytest.raises(ValueError, match=r"\[k0, v0, k1, v1, \.\.\.\], an even count"):
        pk.gather_blocks(caches[:1], np.array([1], np.int32), layout=layout)


def test_layout_rejects_stacking_for_mla_and_strings():
    with pytest.raises(ValueError, match=r"use KVStacking\.NONE"):
        pk.KVLayout(page_format=pk.PageFormat.MLA, kv_stacking=pk.KVStacking.FIRST)
    with pytest.raises(TypeError, match="page_format must be a PageFormat"):
        pk.KVLayout(page_format="NHD")
    with pytest.raises(TypeError, match="layout must be a KVLayout"):
        pk.gather_blocks([jnp.zeros((8, 4))], np.array([1], np.int32), layout="NHD")


def test_backend_and_config_errors(caches):
    ids = np.array([1], np.int32)
    with pytest.raises(pk.BackendUnavailableError, match="backend must be one of"):
        pk.gather_blocks(caches, ids, layout=NHD, backend="cuda")
    with pytest.raises(TypeError, match="must be a TpuConfig, got TritonConfig"):
        pk.gather_blocks(caches, ids, layout=NHD, backend="tpu", config=pk.TritonConfig())
    with pytest.raises(pk.BackendConfigError, match=r"XlaConfig\.word_bytes=3 must be 1, 2 or 4"):
        pk.XlaConfig(word_bytes=3)
    with pytest.raises(pk.BackendConfigError, match=r"word_bytes=4 must divide the page.*\[2, 1\]"):
        cache = jnp.zeros((4, 3), jnp.uint16)  # 6-byte pages
        pk.gather_blocks([cache], ids, layout=pk.KVLayout.raw(), config=pk.XlaConfig(word_bytes=4))


def test_empty_ids_give_empty_staging_and_unchanged_caches(caches):
    empty = np.zeros((0,), np.int32)
    for backend in pk.supported_backends(interpret=True):
        staged = pk.gather_blocks(caches, empty, layout=NHD, backend=backend, interpret=True)
        assert staged.shape == (0, 2, 16, 1, 64) and staged.dtype == jnp.bfloat16
    out = pk.scatter_blocks(caches, empty, _staging(0), layout=NHD, backend="xla")
    assert all(o is c for o, c in zip(out, caches, strict=True))


def test_auto_picks_xla_on_cpu(caches):
    ids = np.array([66, 0], np.int32)
    a = pk.gather_blocks(caches, ids, layout=NHD)
    b = pk.gather_blocks(caches, ids, layout=NHD, backend="reference")
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_check_block_ids_is_public_for_use_before_jit():
    with pytest.raises(pk.DuplicateBlockIdsError):
        pk.check_block_ids(np.array([1, 1], np.int32), 8, unique=True)
    ids = np.array([1, 1], np.int32)
    assert pk.check_block_ids(ids, 8, unique=False) is ids
