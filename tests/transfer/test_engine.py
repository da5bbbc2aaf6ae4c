"""TransferEngine: bit-exact store/load round trips, buckets, failures, misuse."""

from __future__ import annotations

import threading

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload.hostmem import HostChunkPool
from jax_kvoffload.transfer import (
    Direction,
    GroupCaches,
    GroupTransfer,
    TransferEngine,
    TransferError,
    TransferStateError,
    bucket_sizes,
)

NB = 16  # blocks per cache: tiny, the kernels run on CPU

DTYPES = [
    jnp.bfloat16,
    jnp.float16,
    jnp.float32,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    jnp.int8,
    jnp.uint8,
]
LAYOUTS = {
    "nhd": (pk.KVLayout.nhd(), (NB, 4, 2, 8)),
    "hnd": (pk.KVLayout.hnd(), (NB, 2, 4, 8)),
    "kv_first": (pk.KVLayout.nhd(pk.KVStacking.FIRST), (2, NB, 4, 2, 8)),
    "kv_second": (pk.KVLayout.nhd(pk.KVStacking.SECOND), (NB, 2, 4, 2, 8)),
    "mla": (pk.KVLayout.mla(), (NB, 4, 24)),
    "raw": (pk.KVLayout.raw(), (NB, 96)),
}


def random_arrays(shape, dtype, layers, seed=0):
    rng = np.random.default_rng(seed)
    itemsize = np.dtype(dtype).itemsize
    # Random bits, viewed as the dtype: every bit pattern (NaNs included) must survive.
    bits = rng.integers(0, 256, (*shape, itemsize), dtype=np.uint8)
    return [
        jnp.asarray(np.ascontiguousarray(np.roll(bits, k)).view(dtype).reshape(shape))
        for k in range(layers)
    ]


def bits(array) -> np.ndarray:
    a = np.asarray(array)
    return a.view(np.uint8).reshape((*a.shape, -1)) if a.dtype.itemsize else a


def block(array, layout, b):
    a = np.asarray(array)
    return a[:, b] if layout.kv_stacking is pk.KVStacking.FIRST else a[b]


def make_engine(layout, shape, dtype, layers=2, num_chunks=8, bpc=2, max_bucket=4):
    arrays = random_arrays(shape, dtype, layers)
    gc = GroupCaches(arrays, layout)
    pool = HostChunkPool(num_chunks, {0: gc.block_bytes}, bpc)
    engine = TransferEngine({0: gc}, pool, backend="xla", max_bucket=max_bucket)
    return engine, [np.asarray(a).copy() for a in arrays]


ROUND_TRIPS = [
    pytest.param(name, dtype, id=f"{name}-{np.dtype(dtype).name}")
    for name in sorted(LAYOUTS)
    for dtype in DTYPES
    # raw page views hold integer words only
    if name != "raw" or np.dtype(dtype).kind in "ui"
]


@pytest.mark.parametrize(("layout_name", "dtype"), ROUND_TRIPS)
def test_round_trip_is_bit_exact(layout_name, dtype):
    layout, shape = LAYOUTS[layout_name]
    engine, before = make_engine(layout, shape, dtype)
    src, dst = (3, 5, 7, 9, 15), (0, 1, 2, 12, 13)
    with engine:
        # starts mid-chunk (slot 1 of chunk 4) and ends mid-chunk (slot 1 of chunk 6)
        engine.submit_store(1, [GroupTransfer(0, src, (4, 1, 6), first_slot=1)])
        # A load may only read chunks whose store completed (the manager's rule).
        assert engine.wait([1])[0].success
        engine.submit_load(2, [GroupTransfer(0, dst, (4, 1, 6), first_slot=1)])
        assert engine.wait([2])[0].success
        after = [np.asarray(a) for a in engine.arrays(0)]
    for layer in range(2):
        for s, d in zip(src, dst):
            np.testing.assert_array_equal(
                bits(block(after[layer], layout, d)), bits(block(before[layer], layout, s))
            )
        untouched = [b for b in range(NB) if b not in dst]
        for b in untouched:
            np.testing.assert_array_equal(
                bits(block(after[layer], layout, b)), bits(block(before[layer], layout, b))
            )


def test_bucket_sizes_are_powers_of_two():
    assert bucket_sizes(13, 8) == [8, 4, 1]
    assert bucket_sizes(20, 8) == [8, 8, 4]
    assert bucket_sizes(0, 8) == []
    with pytest.raises(ValueError, match="power of two"):
        bucket_sizes(3, 6)


def test_many_blocks_split_into_buckets_round_trip():
    layout, shape = LAYOUTS["nhd"]
    engine, before = make_engine(layout, shape, jnp.uint16, num_chunks=8, bpc=2, max_bucket=4)
    ids = tuple(range(NB - 1, 2, -1))  # 13 blocks -> 4 + 4 + 4 + 1
    with engine:
        engine.submit_store(7, [GroupTransfer(0, ids, tuple(range(7)))])
        (store,) = engine.wait([7])
        assert store.success and store.size_bytes == 13 * engine._caches[0].block_bytes
        # Overwrite the device blocks, then load them back.
        zeros = [jnp.zeros_like(a) for a in engine.arrays(0)]
        engine._caches[0].arrays = zeros
        engine.submit_load(8, [GroupTransfer(0, ids, tuple(range(7)))])
        assert engine.wait([8])[0].success
        after = [np.asarray(a) for a in engine.arrays(0)]
    for layer in range(2):
        np.testing.assert_array_equal(after[layer][list(ids)], before[layer][list(ids)])
        np.testing.assert_array_equal(after[layer][:3], 0)


def test_get_finished_never_blocks_and_reports_each_job_once():
    layout, shape = LAYOUTS["mla"]
    engine, _ = make_engine(layout, shape, jnp.uint8)
    with engine:
        engine.submit_store(1, [GroupTransfer(0, (1, 2), (0,))])
        seen = []
        for _ in range(2000):
            seen += engine.get_finished()
            if seen:
                break
        engine.wait([]) if seen else seen.extend(engine.wait([1]))
        assert [(r.job_id, r.direction, r.success) for r in seen] == [(1, Direction.STORE, True)]
        assert engine.get_finished() == []
        with pytest.raises(TransferError, match="unknown or were already collected"):
            engine.wait([1])


def test_a_failing_host_write_fails_the_store_and_nothing_else(monkeypatch):
    layout, shape = LAYOUTS["nhd"]
    engine, _ = make_engine(layout, shape, jnp.uint16)
    with engine:
        calls = {"n": 0}
        real = engine._pool.write_blocks

        def flaky(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 1:
                raise MemoryError("host memory exhausted")
            return real(*args, **kwargs)

        monkeypatch.setattr(engine._pool, "write_blocks", flaky)
        engine.submit_store(1, [GroupTransfer(0, (1,), (0,))])
        engine.submit_store(2, [GroupTransfer(0, (2,), (1,))])
        bad, good = engine.wait([1, 2])
    assert not bad.success and "MemoryError: host memory exhausted" in bad.error
    assert good.success and good.error is None


def engine_with_blocks_stored():
    """An nhd uint16 engine whose chunk 0 holds blocks 1 and 2 (job 1, collected)."""
    layout, shape = LAYOUTS["nhd"]
    engine, before = make_engine(layout, shape, jnp.uint16)
    engine.submit_store(1, [GroupTransfer(0, (1, 2), (0,))])
    assert engine.wait([1])[0].success
    return engine, before


@pytest.mark.parametrize("inline", [False, True], ids=["load_thread", "inline"])
def test_a_failing_load_leaves_the_caches_untouched(monkeypatch, inline):
    engine, before = engine_with_blocks_stored()
    with engine:

        def broken(*args, **kwargs):
            raise OSError("transfer failed")

        monkeypatch.setattr(engine._pool, "read_blocks", broken)
        engine.submit_load(2, [GroupTransfer(0, (5, 6), (0,))], inline=inline)  # no raise
        (result,) = engine.wait([2])
        after = [np.asarray(a) for a in engine.arrays(0)]
    assert not result.success and "OSError" in result.error
    for layer in range(2):
        np.testing.assert_array_equal(after[layer], before[layer])


@pytest.mark.parametrize(
    ("transfer", "message"),
    [
        (GroupTransfer(3, (1,), (0,)), "unknown group 3"),
        (GroupTransfer(0, (1, 2, 3), (0,)), "need 2 chunks, got 1"),
        (GroupTransfer(0, (1,), (99,)), r"chunk ids \[99\] are outside"),
        (GroupTransfer(0, (NB,), (0,)), r"block ids must be in \[0, 16\)"),
        (GroupTransfer(0, (1,), (0,), first_slot=2), r"first_slot=2 must be in \[0, 2\)"),
    ],
)
def test_malformed_jobs_are_refused_before_anything_runs(transfer, message):
    layout, shape = LAYOUTS["nhd"]
    engine, _ = make_engine(layout, shape, jnp.uint16)
    with engine:
        with pytest.raises((TransferError, ValueError), match=message):
            engine.submit_store(1, [transfer])
        assert engine.get_finished() == []


def test_duplicate_load_ids_and_reused_job_ids_are_refused():
    layout, shape = LAYOUTS["nhd"]
    engine, _ = make_engine(layout, shape, jnp.uint16)
    with engine:
        with pytest.raises(TransferError, match="must be unique"):
            engine.submit_load(1, [GroupTransfer(0, (2, 2), (0,))])
        engine.submit_store(1, [GroupTransfer(0, (2,), (0,))])
        with pytest.raises(TransferError, match="already in use"):
            engine.submit_store(1, [GroupTransfer(0, (3,), (1,))])
        engine.wait([1])
    engine.close()  # idempotent
    with pytest.raises(TransferStateError, match="closed"):
        engine.submit_store(2, [GroupTransfer(0, (3,), (1,))])


def test_pool_must_match_the_caches():
    layout, shape = LAYOUTS["nhd"]
    gc = GroupCaches(random_arrays(shape, jnp.uint16, 2), layout)
    with pytest.raises(TransferError, match="bytes per block"):
        TransferEngine({0: gc}, HostChunkPool(4, {0: gc.block_bytes + 1}, 1))


def test_a_discarded_load_is_reported_failed_and_never_writes():
    layout, shape = LAYOUTS["nhd"]
    engine, before = make_engine(layout, shape, jnp.uint16)
    with engine:
        engine.submit_store(1, [GroupTransfer(0, (1, 2), (0,))])
        engine.wait([1])
        engine.submit_load(2, [GroupTransfer(0, (5, 6), (0,))])
        assert engine.knows(2) and not engine.knows(3)
        engine.discard(2)
        engine.join()
        assert engine.has_finished()
        (result,) = engine.get_finished()
        assert not engine.has_finished()
        after = [np.asarray(a) for a in engine.arrays(0)]
    assert result.job_id == 2 and not result.success and "discarded" in result.error
    for layer in range(2):
        np.testing.assert_array_equal(after[layer], before[layer])


def test_results_outlive_close():
    layout, shape = LAYOUTS["nhd"]
    engine, _ = make_engine(layout, shape, jnp.uint16)
    engine.submit_store(1, [GroupTransfer(0, (1, 2), (0,))])
    engine.close()  # waits for the job and completes it
    assert engine.closed and engine.in_flight == 0
    assert [r.job_id for r in engine.get_finished()] == [1]


@pytest.mark.parametrize("backend", ["triton", "tpu", "mosaic_gpu"])
def test_a_backend_the_caches_platform_does_not_run_is_refused_at_construction(backend):
    """On CPU, a Pallas GPU/TPU backend without interpret=True would only fail at the
    first job; the engine refuses it up front and names what runs here."""
    import jax

    if pk.get_backend(backend).supports(jax.devices()[0]):
        pytest.skip(f"{backend} runs on this machine")
    caches = {0: GroupCaches([jnp.zeros((4, 2, 16, 1, 8), jnp.uint16)], LAYOUTS["kv_second"][0])}
    pool = HostChunkPool(2, {0: caches[0].block_bytes}, 2)
    with pytest.raises(TransferError, match=r"does not run on group 0's caches \(cpu\).*xla"):
        TransferEngine(caches, pool, backend=backend)


def test_ended_jobs_are_freed_without_the_cyclic_collector():
    """A job's end-time callback once held the job (job.future -> callback -> job): every
    finished job, and a load's staging the size of the job, lived on until the cyclic
    collector ran; several dead 512 MiB loads halved the load speed on CPU."""
    import gc

    from jax_kvoffload.transfer._job_core import EngineJob

    layout, shape = LAYOUTS["kv_second"]
    engine, _ = make_engine(layout, shape, jnp.uint16, max_bucket=2)
    transfer = GroupTransfer(0, (1, 2, 3, 4, 5), (0, 1, 2))  # 3 load pieces: 2 + 2 + 1
    gc.collect()
    # type(), not isinstance(): isinstance reads `__class__`, and some objects of other
    # libraries (torch's deprecated `reduce_op`) warn when asked, which is an error here.
    earlier = [o for o in gc.get_objects() if type(o) is EngineJob]  # other engines'
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with engine:
            engine.submit_store(1, [transfer])
            assert engine.wait([1])[0].success
            engine.submit_load(2, [transfer])
            (load,) = engine.wait([2])
            engine.submit_load(3, [transfer])
            engine.discard(3)
            engine.join()
            engine.get_finished()
        # Counted once the worker threads have ended: a thread that has just completed a
        # job may still hold it in a local until it takes the next one (not a leak).
        alive = [
            o for o in gc.get_objects() if type(o) is EngineJob and not any(o is e for e in earlier)
        ]
    finally:
        if was_enabled:
            gc.enable()
    assert alive == []
    assert load.success and load.seconds > 0  # the job's own time is still measured


def _load_threads(monkeypatch, engine) -> list[str]:
    """The names of the threads that read each load's rows."""
    names: list[str] = []
    read = engine._pool.read_blocks

    def recording(*args, **kwargs):
        names.append(threading.current_thread().name)
        return read(*args, **kwargs)

    monkeypatch.setattr(engine._pool, "read_blocks", recording)
    return names


def test_an_inline_load_reads_on_the_callers_thread_and_writes_what_a_threaded_one_does(
    monkeypatch,
):
    layout, shape = LAYOUTS["kv_second"]
    results = {}
    for inline in (False, True):
        engine, before = make_engine(layout, shape, ml_dtypes.float8_e4m3fn)
        names = _load_threads(monkeypatch, engine)
        with engine:
            engine.submit_store(1, [GroupTransfer(0, (3, 9, 15), (2, 3))])
            assert engine.wait([1])[0].success
            engine.submit_load(2, [GroupTransfer(0, (0, 4, 12), (2, 3))], inline=inline)
            (load,) = engine.wait([2])
            assert load.success and load.size_bytes == 3 * engine._caches[0].block_bytes
            results[inline] = [bits(a) for a in engine.arrays(0)]
        where = "MainThread" if inline else "kv-load_0"  # two pieces: 2 + 1 blocks
        assert names == [where, where], names
    for a, b, orig in zip(results[False], results[True], before, strict=True):
        np.testing.assert_array_equal(a, b)
        for s, d in zip((3, 9, 15), (0, 4, 12)):
            np.testing.assert_array_equal(block(b, layout, d), bits(block(orig, layout, s)))
        kept = [k for k in range(NB) if k not in (0, 4, 12)]
        np.testing.assert_array_equal(block(b, layout, kept), bits(block(orig, layout, kept)))


def test_an_inline_load_behind_a_store_on_its_rows_waits_on_the_load_thread(monkeypatch):
    layout, shape = LAYOUTS["nhd"]
    engine, before = make_engine(layout, shape, jnp.uint16)
    names = _load_threads(monkeypatch, engine)
    gate, write = threading.Event(), engine._copies.write
    monkeypatch.setattr(engine._copies, "write", lambda staged: (gate.wait(10), write(staged)))
    with engine:
        engine.submit_store(1, [GroupTransfer(0, (1, 2), (0,))])  # still writing chunk 0
        engine.submit_load(2, [GroupTransfer(0, (7, 8), (0,))], inline=True)  # returns
        assert engine.knows(2) and not names  # queued behind the store, not run here
        gate.set()
        (store, load) = engine.wait([1, 2])
        after = [np.asarray(a) for a in engine.arrays(0)]
    assert store.success and load.success and names == ["kv-load_0"]
    for layer in range(2):  # the load read what the store wrote, not the rows before it
        np.testing.assert_array_equal(after[layer][[7, 8]], before[layer][[1, 2]])


def test_an_inline_load_with_futures_to_wait_for_runs_on_the_load_thread(monkeypatch):
    from concurrent.futures import Future

    layout, shape = LAYOUTS["nhd"]
    engine, _ = make_engine(layout, shape, jnp.uint16)
    names = _load_threads(monkeypatch, engine)
    promotion: Future = Future()
    with engine:
        engine.submit_store(1, [GroupTransfer(0, (1,), (0,))])
        engine.wait([1])
        engine.submit_load(2, [GroupTransfer(0, (5,), (0,))], after=[promotion], inline=True)
        assert not names
        promotion.set_result(None)
        assert engine.wait([2])[0].success
    assert names == ["kv-load_0"]
