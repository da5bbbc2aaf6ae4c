"""`ScatterPlan` (`plan_scatter`): scatter_blocks checked and resolved once per geometry.

Its bits on sharded meshes are in the randomized suite (sharded_bits_run.py, `via=plan`
and `via=plan_device_ids`); here, one device: the same bytes as `scatter_blocks` and every
page it does not name kept, the typed errors of every entry, and the list-based id
checks (`checks._fine`) against numpy's answer on random ids.
"""

from __future__ import annotations

import os
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.blocks import checks

from .cases import LAYOUTS, NUM_BLOCKS, Case, assert_same_bits, make_caches

SEED = int(os.environ.get("PK_PLAN_SEED", time.time_ns() % 2**31))


def _staging(rng, caches, layout, n):
    shape = (n, len(caches), *layout.page_shape(tuple(caches[0].shape)))
    bits = rng.integers(0, 256, size=int(np.prod(shape)) * caches[0].dtype.itemsize)
    return bits.astype(np.uint8).view(caches[0].dtype).reshape(shape)


@pytest.mark.parametrize("layout", ["nhd", "hnd_kv_second", "nhd_kv_separate", "mla"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3", "fp32"])
@pytest.mark.parametrize("ids_on", ["numpy", "device"])
def test_plan_writes_what_scatter_blocks_writes(layout, dtype, ids_on):
    print(f"PK_PLAN_SEED={SEED}")
    rng = np.random.default_rng([SEED, zlib.crc32(f"{layout}-{dtype}-{ids_on}".encode())])
    case = Case(layout, dtype, 2, 16, 8, 0, num_heads=2)
    lay = LAYOUTS[layout]
    # Random bits everywhere (NaN payloads included), committed to a device as an
    # engine's caches are (uncommitted ones take numpy ids only: a test below).
    before = [jax.device_put(c, jax.devices()[0]) for c in make_caches(case)]
    snapshot = [np.asarray(c).copy() for c in before]
    n = int(rng.integers(1, 9))
    ids = rng.permutation(NUM_BLOCKS)[:n].astype(np.int32)
    staging = _staging(rng, before, lay, n)
    want = pk.scatter_blocks([jnp.array(s) for s in snapshot], ids, staging, layout=lay)
    plan = pk.plan_scatter(before, layout=lay)
    arg = jax.device_put(ids, plan.ids_sharding) if ids_on == "device" else ids
    got = plan(before, arg, staging)
    for g, w, s in zip(got, want, snapshot, strict=True):
        assert_same_bits(np.asarray(g), np.asarray(w))
        others = np.setdiff1d(np.arange(NUM_BLOCKS), ids)
        axis = lay.block_axis
        assert_same_bits(np.take(np.asarray(g), others, axis), np.take(s, others, axis))


def test_plan_serves_every_call_of_its_geometry():
    case = Case("nhd", "bf16", 2, 16, 8, 0)
    caches = make_caches(case)
    plan = pk.plan_scatter(caches, layout=LAYOUTS["nhd"])
    rng = np.random.default_rng(SEED)
    for n in (1, 3, 8, 3):  # new sizes compile once each; the plan is the same
        ids = rng.permutation(NUM_BLOCKS)[:n].astype(np.int32)
        staging = _staging(rng, caches, LAYOUTS["nhd"], n)
        caches = plan(caches, ids, staging)
        back = pk.gather_blocks(caches, ids, layout=LAYOUTS["nhd"])
        assert_same_bits(np.asarray(back), staging)
    assert plan.matches(caches)


def test_plan_refuses_caches_of_another_geometry():
    caches = make_caches(Case("nhd", "bf16", 2, 16, 8, 0))
    plan = pk.plan_scatter(caches, layout=LAYOUTS["nhd"])
    other = make_caches(Case("nhd", "bf16", 3, 16, 8, 0))
    staging = np.zeros((1, 3, 16, 1, 8), jnp.bfloat16)
    with pytest.raises(pk.LayerMismatchError, match="plan_scatter"):
        plan(other, np.array([0], np.int32), staging)
    assert not plan.matches(other)
    assert not other[0].is_deleted()  # refused before anything was donated


@pytest.mark.parametrize(
    "ids, error",
    [
        (np.array([NUM_BLOCKS], np.int32), pk.BlockIdsOutOfRangeError),
        (np.array([-1], np.int32), pk.BlockIdsOutOfRangeError),
        (np.array([2, 2], np.int32), pk.DuplicateBlockIdsError),
        (np.array([1], np.int64), pk.BlockIdsDtypeError),
        (jnp.array([[1]], jnp.int32), pk.BlockIdsError),
        ([1, 2], pk.BlockIdsError),
    ],
)
def test_plan_checks_block_ids(ids, error):
    caches = make_caches(Case("nhd", "bf16", 1, 16, 8, 0))
    plan = pk.plan_scatter(caches, layout=LAYOUTS["nhd"])
    n = int(np.size(ids))
    with pytest.raises(error):
        plan(caches, ids, np.zeros((n, 1, 16, 1, 8), jnp.bfloat16))
    assert not caches[0].is_deleted()


def test_plan_checks_staging():
    caches = make_caches(Case("nhd", "bf16", 1, 16, 8, 0))
    plan = pk.plan_scatter(caches, layout=LAYOUTS["nhd"])
    ids = np.array([3], np.int32)
    with pytest.raises(pk.StagingMismatchError):
        plan(caches, ids, np.zeros((2, 1, 16, 1, 8), jnp.bfloat16))  # 2 rows for 1 id
    with pytest.raises(pk.StagingMismatchError):
        plan(caches, ids, np.zeros((1, 1, 16, 1, 8), jnp.float16))


def test_uncommitted_caches_take_numpy_ids_only():
    caches = [jnp.zeros((NUM_BLOCKS, 16, 1, 8), jnp.bfloat16)]  # uncommitted
    plan = pk.plan_scatter(caches, layout=LAYOUTS["nhd"])
    assert plan.ids_sharding is None
    staging = np.ones((1, 1, 16, 1, 8), jnp.bfloat16)
    with pytest.raises(pk.BlockIdsError, match="numpy block ids only"):
        plan(caches, jnp.array([0], jnp.int32), staging)
    out = plan(caches, np.array([5], np.int32), staging)
    assert float(out[0][5].sum()) == 16 * 8


def test_plan_needs_concrete_caches():
    def traced(c):
        return pk.plan_scatter([c], layout=LAYOUTS["nhd"])

    with pytest.raises(TypeError, match="concrete caches"):
        jax.jit(traced)(jnp.zeros((4, 16, 1, 8), jnp.bfloat16))


def test_plan_is_exported_and_checked_like_scatter_blocks():
    with pytest.raises(TypeError, match="KVLayout"):
        pk.plan_scatter(make_caches(Case("nhd", "bf16", 1, 16, 8, 0)), layout="nhd")
    assert "ScatterPlan" in pk.__all__ and "plan_scatter" in pk.__all__


def test_list_checks_agree_with_numpy_on_random_ids():
    """`_fine` (few ids, as a Python list) says yes exactly where numpy finds nothing."""
    print(f"PK_PLAN_SEED={SEED}")
    rng = np.random.default_rng(SEED)
    for _ in range(2000):
        nb = int(rng.integers(0, 10))
        ids = rng.integers(-2, nb + 2, size=int(rng.integers(0, 8)))
        unique = bool(rng.integers(2))
        in_range = bool(((ids >= 0) & (ids < nb)).all())
        distinct = np.unique(ids).size == ids.size
        assert checks._fine(ids.tolist(), nb, unique) == (in_range and (distinct or not unique))


def test_few_ids_still_get_the_numpy_errors():
    for ids, error in (([0, 7], pk.BlockIdsOutOfRangeError), ([1, 1], pk.DuplicateBlockIdsError)):
        with pytest.raises(error):
            pk.check_block_ids(np.array(ids, np.int32), 4, unique=True)
    big = np.arange(checks._FEW_IDS + 1, dtype=np.int32)  # the numpy path
    big[-1] = 0
    with pytest.raises(pk.DuplicateBlockIdsError):
        pk.check_block_ids(big, len(big), unique=True)
