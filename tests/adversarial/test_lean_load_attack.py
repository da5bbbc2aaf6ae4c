"""Red-team tests for the lean small loads: `ScatterPlan` (pallas_kernels/blocks/prepared.py),
the `check_block_ids` list fast path, and `TransferEngine.submit_load(inline=True)`.

Each test is a finding (fixed in the library; the test keeps it fixed) or an attack that
held up and is kept as a guard. Multi-device cases run in a subprocess with 4 simulated
CPU devices (the rest of the suite initialised jax with one).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload.transfer import GroupTransfer
from pallas_kernels.blocks import checks
from tests.pallas_kernels.cases import LAYOUTS, Case, make_caches
from tests.transfer.test_engine import LAYOUTS as ENGINE_LAYOUTS
from tests.transfer.test_engine import engine_with_blocks_stored, make_engine

LAY = LAYOUTS["nhd"]


def _committed(layers=2):
    # Fresh numpy copies: device_put of an array already on the device returns it as is,
    # and a donation would then delete the source too.
    return [
        jax.device_put(np.asarray(c).copy(), jax.devices()[0])
        for c in make_caches(Case("nhd", "bf16", layers, 16, 8, 0))
    ]


def _staging(caches, n, seed=0):
    shape = (n, len(caches), *LAY.page_shape(tuple(caches[0].shape)))
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2**16, size=shape, dtype=np.uint16).view(caches[0].dtype)


# -- ScatterPlan: findings ------------------------------------------------------------------


@pytest.mark.parametrize("which", [0, 1])
def test_plan_given_donated_caches_raises_a_typed_error_naming_the_fix(which):
    # Finding: a plan called with caches an earlier call donated (the commonest misuse:
    # calling it again with the old list) raised jax's bare RuntimeError "Array has been
    # deleted"; scatter_blocks raises CacheError naming the fix. The engine reported a
    # load onto deleted arrays with that bare RuntimeError too (next test).
    caches = _committed()
    plan = pk.plan_scatter(caches, layout=LAY)
    caches[which].delete()
    with pytest.raises(pk.CacheError, match="deleted"):
        plan(caches, np.array([1], np.int32), _staging(caches, 1))
    assert not caches[1 - which].is_deleted()  # refused before anything was donated


def test_plan_reused_on_the_caches_it_donated_raises_cache_error():
    caches = _committed()
    plan = pk.plan_scatter(caches, layout=LAY)
    out = plan(caches, np.array([1], np.int32), _staging(caches, 1))
    with pytest.raises(pk.CacheError, match="returned"):
        plan(caches, np.array([2], np.int32), _staging(caches, 1))
    assert not any(a.is_deleted() for a in out)


def test_engine_load_onto_deleted_arrays_reports_a_typed_error():
    engine, _ = engine_with_blocks_stored()
    with engine:
        engine.submit_load(2, [GroupTransfer(0, (5, 6), (0,))], inline=True)
        for a in engine.arrays(0):
            a.delete()  # donated elsewhere by the caller between submit and wait
        (result,) = engine.wait([2])
    assert not result.success
    assert "CacheError" in result.error and "deleted" in result.error, result.error


def test_plan_given_no_caches_raises_a_typed_error():
    # Finding: an empty list raised IndexError (from the geometry check).
    real = _committed()
    plan = pk.plan_scatter(real, layout=LAY)
    with pytest.raises(pk.LayerMismatchError, match="plan_scatter"):
        plan([], np.array([1], np.int32), _staging(real, 1))
    assert not any(a.is_deleted() for a in real)


def test_plan_takes_caches_as_any_iterable():
    # Finding: a generator raised TypeError "'generator' object is not subscriptable"
    # (scatter_blocks takes one); now read once into a tuple.
    real = _committed()
    snap = [np.asarray(c).copy() for c in real]
    plan = pk.plan_scatter(real, layout=LAY)
    staging = _staging(real, 2)
    out = plan((c for c in real), np.array([4, 1], np.int32), staging)
    for k, (o, s) in enumerate(zip(out, snap, strict=True)):
        want = s.copy()
        want[[4, 1]] = staging[:, k]
        np.testing.assert_array_equal(np.asarray(o).view(np.uint16), want.view(np.uint16))


# -- ScatterPlan on 4 devices: ids and staging placed elsewhere ------------------------------

MULTI = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import pallas_kernels as pk
    from tests.pallas_kernels.cases import LAYOUTS, Case, make_caches

    lay = LAYOUTS["nhd"]
    devs = jax.devices()
    snap = [np.asarray(c).copy() for c in make_caches(Case("nhd", "bf16", 2, 16, 8, 0))]
    rng = np.random.default_rng(0)
    ids = np.array([3, 5, 7, 9], np.int32)
    shape = (4, 2, *lay.page_shape(snap[0].shape))
    staging = rng.integers(0, 2**16, size=shape, dtype=np.uint16).view(snap[0].dtype)
    mesh = Mesh(np.array(devs), ("x",))
    other = Mesh(np.array(devs[::-1]), ("x",))  # the same devices in another order

    def expect_typed(caches, plan, ids_arg, what):
        try:
            plan(caches, ids_arg, staging)
        except pk.BlockIdsError as e:
            assert "ids_sharding" in str(e), e
        else:
            raise AssertionError(f"{what}: accepted")
        assert not any(c.is_deleted() for c in caches), what

    cases = {
        "one device": devs[0],
        "mesh": NamedSharding(mesh, P()),
        "heads": NamedSharding(mesh, P(None, "x")),
    }
    for name, where in cases.items():
        caches = [jax.device_put(s, where) for s in snap]
        plan = pk.plan_scatter(caches, layout=lay)
        elsewhere = [devs[1]] if name == "one device" else [devs[0], NamedSharding(other, P())]
        for w in elsewhere:
            expect_typed(caches, plan, jax.device_put(ids, w), f"{name}: ids at {w}")
        # At ids_sharding, and uncommitted: the bytes of a numpy model, the rest kept.
        for arg in (jax.device_put(ids, plan.ids_sharding), jax.numpy.asarray(ids), ids):
            caches = [jax.device_put(s, where) for s in snap]
            out = plan(caches, arg, staging)
            for k, (o, s) in enumerate(zip(out, snap)):
                want = s.copy()
                want[ids] = staging[:, k]
                got = np.asarray(o).view(np.uint16)
                assert np.array_equal(got, want.view(np.uint16)), (name, k)
    print("OK")
    """
)


def test_plan_refuses_device_ids_placed_off_its_ids_sharding():
    # Finding: ids committed to another device, or to a mesh of the same devices in
    # another order, reached the jit and raised jax's bare ValueError "Received
    # incompatible devices for jitted computation" (no hint at `ids_sharding`).
    out = subprocess.run([sys.executable, "-c", MULTI], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("OK")


# -- held up: kept as guards -----------------------------------------------------------------


@pytest.mark.parametrize(
    "ids, num_blocks, unique",
    [
        ([], 0, True),
        ([0], 0, True),
        ([0], 1, True),
        ([-1], 5, False),
        ([2**31 - 1], 2**31 - 1, True),
        ([2**31 - 2], 2**31 - 1, True),
        ([-(2**31)], 4, True),
        ([1, 1], 4, False),
        ([1, 1], 4, True),
        (list(range(64)), 64, True),
        (list(range(64)), 63, True),
        ([*range(63), 0], 64, True),
        (list(range(65)), 65, True),
        ([*range(64), 0], 65, True),
    ],
)
def test_check_block_ids_fast_path_agrees_with_the_numpy_path(ids, num_blocks, unique, monkeypatch):
    arr = np.array(ids, np.int32)

    def outcome():
        try:
            checks.check_block_ids(arr, num_blocks, unique=unique)
        except pk.PallasKernelsError as e:
            return type(e)
        return None

    fast = outcome()
    monkeypatch.setattr(checks, "_FEW_IDS", -1)  # numpy path only
    assert outcome() is fast


def test_inline_load_discarded_before_wait_writes_nothing_and_is_reported_once():
    engine, before = engine_with_blocks_stored()
    with engine:
        engine.submit_load(2, [GroupTransfer(0, (5, 6), (0,))], inline=True)
        engine.discard(2)
        (result,) = engine.wait([2])
        assert engine.get_finished() == [] and not engine.knows(2)
        after = [np.asarray(a) for a in engine.arrays(0)]
    assert not result.success
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_inline_load_whose_read_raises_a_base_exception_fails_the_job_only(exc, monkeypatch):
    engine, before = engine_with_blocks_stored()
    with engine:

        def broken(*args, **kwargs):
            raise exc("injected")

        monkeypatch.setattr(engine._pool, "read_blocks", broken)
        engine.submit_load(2, [GroupTransfer(0, (5, 6), (0,))], inline=True)
        (result,) = engine.wait([2])
        assert engine.in_flight == 0
        after = [np.asarray(a) for a in engine.arrays(0)]
    assert not result.success and exc.__name__ in result.error
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a, b)


def test_inline_loads_interleaved_with_a_store_on_their_chunk_read_in_submission_order():
    engine, before = engine_with_blocks_stored()
    with engine:
        engine.submit_load(2, [GroupTransfer(0, (5, 6), (0,))], inline=True)
        engine.submit_store(3, [GroupTransfer(0, (9, 10), (0,))])  # rewrites chunk 0
        engine.submit_load(4, [GroupTransfer(0, (11, 12), (0,))], inline=True)
        results = engine.wait([2, 3, 4])
        after = [np.asarray(a) for a in engine.arrays(0)]
    assert all(r.success for r in results)
    kept = [k for k in range(before[0].shape[0]) if k not in (5, 6, 11, 12)]
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a[[5, 6]], b[[1, 2]])  # before the store
        np.testing.assert_array_equal(a[[11, 12]], b[[9, 10]])  # after it
        np.testing.assert_array_equal(a[kept], b[kept])


def test_close_right_after_an_inline_submit_completes_it():
    engine, before = engine_with_blocks_stored()
    engine.submit_load(2, [GroupTransfer(0, (5, 6), (0,))], inline=True)
    engine.close()
    results = engine.get_finished()
    after = [np.asarray(a) for a in engine.arrays(0)]
    assert [(r.job_id, r.success) for r in results] == [(2, True)]
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a[[5, 6]], b[[1, 2]])


# -- pinned pool: rows joined on the device -------------------------------------------------


@pytest.mark.parametrize("inline", [False, True])
def test_pinned_pool_load_spanning_two_rows_keeps_bf16_nan_payloads(inline):
    # Finding (older than the lean loads, on their path too): a pool that adopts rows
    # (kind="pinned") hands a load its rows as they are; a piece spanning two rows was
    # joined with jnp.concatenate on the device, and XLA:CPU's bf16 concatenate quiets
    # NaN payloads (0x7f99 -> 0x7fc0). Fixed: joined as uint16 (`_copies._join_bits`).
    from jax_kvoffload.hostmem import build_host_pool
    from jax_kvoffload.transfer import GroupCaches, TransferEngine

    layout, shape = ENGINE_LAYOUTS["nhd"]
    rng = np.random.default_rng(7)
    # Signalling NaNs (quiet bit clear, payload set) of both signs, and random bits.
    nan = (0x7F80 | rng.integers(1, 0x40, shape)).astype(np.uint16) | (
        rng.integers(0, 2, shape).astype(np.uint16) << 15
    )
    mixed = np.where(rng.random(shape) < 0.5, nan, rng.integers(0, 2**16, shape)).astype(np.uint16)
    before = [nan, mixed]
    arrays = [jnp.asarray(b.view(jnp.bfloat16)) for b in before]
    gc = GroupCaches(arrays, layout)
    pool, _ = build_host_pool(6, {0: gc.block_bytes}, 3, kind="pinned")
    with TransferEngine({0: gc}, pool, backend="xla", max_bucket=4) as engine:
        # Slots 2..8 of chunks (0, 1, 2), in two store pieces (4 + 3 blocks): rows of
        # their own per piece, so the load of slots 2..4 joins two rows.
        engine.submit_store(1, [GroupTransfer(0, (1, 2, 3, 4, 5, 6, 7), (0, 1, 2), 2)])
        assert engine.wait([1])[0].success
        engine.submit_load(2, [GroupTransfer(0, (10, 11, 12), (0, 1), 2)], inline=inline)
        (load,) = engine.wait([2])
        after = [np.asarray(a).view(np.uint16) for a in engine.arrays(0)]
    assert load.success, load.error
    kept = [k for k in range(shape[0]) if k not in (10, 11, 12)]
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a[[10, 11, 12]], b[[1, 2, 3]])
        np.testing.assert_array_equal(a[kept], b[kept])


# -- set_arrays onto other devices between submit and wait (4 devices) --------------------

MOVED = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import pallas_kernels as pk
    from jax_kvoffload.hostmem import build_host_pool
    from jax_kvoffload.transfer import GroupCaches, GroupTransfer, TransferEngine, _copies

    devs = jax.devices()
    mesh = Mesh(np.array(devs), ("tp",))
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**16, (8, 4, 8, 16), dtype=np.uint16)
    bits[2, 0, 0, :] = 0x7F81  # a NaN payload
    before = [np.roll(bits, k).copy() for k in range(2)]
    heads = NamedSharding(mesh, P(None, None, "tp", None))
    places = {"heads": heads, "blocks": NamedSharding(mesh, P("tp")), "device 1": devs[1]}
    for kind in ("numpy", "pinned"):
        for whole in (0, 1 << 20):  # numpy pools: shard by shard, or one host buffer
            for inline in (False, True):
                for start, end in (("heads", "device 1"), ("device 1", "heads"),
                                   ("blocks", "device 1")):
                    _copies.WHOLE_PIECE_BYTES = whole
                    arrays = [jax.device_put(b.view(jnp.bfloat16), places[start]) for b in before]
                    gc = GroupCaches(arrays, pk.KVLayout.nhd())
                    pool, _ = build_host_pool(4, {0: gc.block_bytes}, 2, kind=kind)
                    with TransferEngine({0: gc}, pool, backend="xla") as engine:
                        engine.submit_store(1, [GroupTransfer(0, (2, 5), (3,))])
                        engine.submit_store(2, [GroupTransfer(0, (7,), (0,))])
                        assert all(r.success for r in engine.wait([1, 2]))
                        engine.submit_load(3, [GroupTransfer(0, (0, 6, 3), (3, 0))], inline=inline)
                        moved = [jax.device_put(b.view(jnp.bfloat16), places[end]) for b in before]
                        engine.set_arrays(0, moved)
                        (load,) = engine.wait([3])
                        what = (kind, whole, inline, start, end)
                        assert load.success, (what, load.error)
                        after = [np.asarray(a).view(np.uint16) for a in engine.arrays(0)]
                    for layer in range(2):
                        got, was = after[layer], before[layer]
                        assert np.array_equal(got[[0, 6, 3]], was[[2, 5, 7]]), what
                        assert np.array_equal(got[[1, 2, 4, 5, 7]], was[[1, 2, 4, 5, 7]]), what
    print("OK")
    """
)


def test_a_load_in_flight_follows_its_caches_onto_other_devices():
    # Finding (older than the lean loads; inline numpy-pool loads escaped it, their
    # staging stays on the host): set_arrays that moves a group's caches to another
    # device set (a mesh -> one device, or back) between submit_load and wait failed
    # the load with StagingMismatchError: its staging was placed on the old devices at
    # the fetch. set_arrays allows any sharding (the engine re-plans). Fixed: the
    # scatter moves such a staging to the caches' devices first (a byte copy).
    out = subprocess.run([sys.executable, "-c", MOVED], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("OK")


def test_a_real_ctrl_c_during_an_inline_fetch_arrives_after_the_job_is_registered(monkeypatch):
    import os
    import signal

    engine, before = engine_with_blocks_stored()
    with engine:
        real = engine._pool.read_blocks

        def ctrl_c(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)  # held: delivered once the fetch is done
            return real(*args, **kwargs)

        monkeypatch.setattr(engine._pool, "read_blocks", ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            engine.submit_load(2, [GroupTransfer(0, (5, 6), (0,))], inline=True)
        assert engine.knows(2)  # registered: reported once, as the docstring says
        (result,) = engine.wait([2])
        assert engine.get_finished() == []
        after = [np.asarray(a) for a in engine.arrays(0)]
    assert result.success, result.error
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a[[5, 6]], b[[1, 2]])
        np.testing.assert_array_equal(np.delete(a, [5, 6], 0), np.delete(b, [5, 6], 0))


def test_an_inline_load_does_not_overtake_an_earlier_load_still_queued():
    # Finding: loads ran FIFO on their lane's thread, so a later load's fetch never
    # ended before an earlier one's and completions (in submission order among the
    # ended jobs) scattered them in order. An inline load skipped the queue: with an
    # earlier load still waiting (here on a promotion), get_finished() scattered the
    # later load first and the earlier one's completion then overwrote its blocks with
    # older bytes. Fixed: a load runs inline only when no earlier job of its lane is
    # still running (JobCore.submit).
    from concurrent.futures import Future

    layout, shape = ENGINE_LAYOUTS["nhd"]
    engine, before = make_engine(layout, shape, jnp.uint16)
    promotion: Future = Future()
    with engine:
        engine.submit_store(1, [GroupTransfer(0, (1, 2), (0,))])
        engine.submit_store(2, [GroupTransfer(0, (3, 4), (1,))])
        assert all(r.success for r in engine.wait([1, 2]))
        engine.submit_load(3, [GroupTransfer(0, (5, 6), (0,))], after=[promotion])  # older
        engine.submit_load(4, [GroupTransfer(0, (5, 6), (1,))], inline=True)  # newer
        early = engine.get_finished()
        promotion.set_result(None)
        rest = engine.wait([j for j in (3, 4) if j not in {r.job_id for r in early}])
        after = [np.asarray(a) for a in engine.arrays(0)]
    assert all(r.success for r in early + rest)
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a[[5, 6]], b[[3, 4]])  # the later load's bytes


def test_a_byte_swapped_staging_is_refused_with_a_message_that_says_so():
    # Finding (check_staging, shared with scatter_blocks): a big-endian float32 staging
    # was refused with "must have the caches' dtype float32, got float32".
    caches = [
        jax.device_put(np.asarray(c).copy(), jax.devices()[0])
        for c in make_caches(Case("nhd", "fp32", 1, 16, 8, 0))
    ]
    plan = pk.plan_scatter(caches, layout=LAY)
    staging = np.zeros((1, 1, *LAY.page_shape(tuple(caches[0].shape))), ">f4")
    for call in (
        lambda: plan(caches, np.array([1], np.int32), staging),
        lambda: pk.scatter_blocks(caches, np.array([1], np.int32), staging, layout=LAY),
    ):
        with pytest.raises(pk.StagingMismatchError, match="byte order"):
            call()
    assert not caches[0].is_deleted()


def test_plan_takes_host_staging_of_any_memory_layout():
    # Held up: transposed, Fortran-ordered, strided and read-only numpy stagings.
    snap = [np.asarray(c).copy() for c in make_caches(Case("nhd", "fp32", 2, 16, 8, 0))]
    shape = (3, 2, *LAY.page_shape(snap[0].shape))
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2**32, size=shape[::-1], dtype=np.uint32).view(np.float32)
    frozen = np.ascontiguousarray(base.T)
    frozen.setflags(write=False)
    ids = np.array([4, 0, 9], np.int32)
    for staging in (base.T, np.asfortranarray(base.T), np.repeat(base.T, 2, axis=0)[::2], frozen):
        caches = [jax.device_put(x.copy(), jax.devices()[0]) for x in snap]
        out = pk.plan_scatter(caches, layout=LAY)(caches, ids, staging)
        for k, (o, s) in enumerate(zip(out, snap, strict=True)):
            want = s.copy()
            want[ids] = staging[:, k]
            np.testing.assert_array_equal(np.asarray(o).view(np.uint32), want.view(np.uint32))
