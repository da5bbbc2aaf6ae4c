"""Interrupts at every caller-side step (issue 12, defect 6).

A scenario (store, wait, lookup, load, store, poll, reset, store, wait, load, close) is
run once per instrumented call the offloader makes on the caller's thread (kernels,
device_put, the store's bookkeeping, thread queues), with a KeyboardInterrupt raised
instead of that call ("raise"), or a real SIGINT arriving just after it ("signal").
Whatever step is hit, afterwards: the interrupted call re-raised; every job id handed
out is reported exactly once; a load that reports success delivered its keys' bytes;
nothing stays pinned or write-pending; close() works and leaves no thread (conftest).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload.hostmem import HostChunkPool
from jax_kvoffload.transfer import GroupCaches, GroupTransfer, TransferEngine
from tests.faults._helpers import (
    Injector,
    Reports,
    blocks,
    expected,
    hashes,
    interruptible,
    noise,
    offloader,
    pins,
    write_blocks,
)

A, B = hashes("a", 4), hashes("b", 4)


def scenario(off, reports: Reports, loads: dict[int, tuple[list[int], list[bytes]]]) -> int:
    """Runs the steps, swallowing interrupts; returns how many steps were interrupted."""
    hit = 0

    def step(fn):
        nonlocal hit
        with interruptible() as caught:
            return fn()
        hit += bool(caught)
        return None

    def load(hashes_, dst):
        n = step(lambda: off.lookup(hashes_)) or 0
        job = reports.issue(step(lambda: off.load(hashes_[:n], dst[:n])) if n else None)
        if job is not None:
            loads[job] = (dst[:n], hashes_[:n])

    j1 = reports.issue(step(lambda: off.store(A, [1, 2, 3, 4])))
    if j1 is not None:
        reports.record(step(lambda: off.wait([j1])) or [])
    load(A, [10, 11, 12, 13])
    reports.issue(step(lambda: off.store(B, [5, 6, 7, 8])))
    off._engine.join()  # (not instrumented) so that poll finds the same jobs ended each run
    reports.record(step(off.poll) or [])
    step(off.reset_cache)
    reports.issue(step(lambda: off.store(A, [1, 2, 3, 4])))
    reports.record(step(off.wait) or [])
    load(A, [20, 21, 22, 23])
    reports.record(step(off.close) or [])
    return hit


def run(monkeypatch, at: int, mode: str) -> Injector:
    off = offloader()
    write_blocks(off, [1, 2, 3, 4], A)
    write_blocks(off, [5, 6, 7, 8], B)
    injector = Injector(monkeypatch)
    injector.arm(at, mode)
    reports, loads = Reports(), {}
    hit = scenario(off, reports, loads)
    injector.disarm()
    assert hit == (injector.fired is not None), (hit, injector.fired)
    # Idempotent; returns what an interrupted close could not.
    reports.record(off.close())
    context = f"interrupt {injector.fired}"
    reports.check_exactly_once(context)
    assert pins(off) == (0, 0), context
    # A donated scatter's result was never dropped: the caches are alive.
    assert not any(a.is_deleted() for a in off.caches()), context
    for job, (dst, hashes_) in loads.items():
        if reports.results[job].success:
            np.testing.assert_array_equal(blocks(off, dst), expected(hashes_), err_msg=context)
    monkeypatch.undo()
    return injector


def calls_in_scenario(monkeypatch) -> int:
    counter = run(monkeypatch, at=10**9, mode="raise")
    return counter.calls


@pytest.mark.parametrize("mode", ["raise", "signal"])
def test_an_interrupt_at_any_caller_step_leaves_consistent_state(monkeypatch, mode):
    total = calls_in_scenario(monkeypatch)
    assert total >= 20, total  # the scenario does reach the instrumented calls
    fired = set()
    for at in range(1, total + 3):  # a few more: poll may complete more jobs
        injector = run(monkeypatch, at, mode)
        if injector.fired:
            fired.add(injector.fired.split(" (")[0])
    # every kind of caller step was hit at least once
    names = {f.split(" at ")[1] for f in fired}
    for name in (
        "pallas_kernels.gather_blocks",
        "ScatterPlan.__call__",
        "HostStore.prepare_store",
        "HostStore.prepare_load",
        "HostStore.complete_store",
        "HostStore.complete_load",
        "HostStore.reset_cache",
        "ThreadPoolExecutor.submit",
    ):
        assert name in names, (name, sorted(names))


def engine_with_a_stored_chunk():
    arrays = noise(3)
    before = [np.asarray(a).copy() for a in arrays]
    gc = GroupCaches(arrays, pk.KVLayout.nhd())
    pool = HostChunkPool(4, {0: gc.block_bytes}, 4)
    engine = TransferEngine({0: gc}, pool, backend="xla", max_bucket=2)
    engine.submit_store(1, [GroupTransfer(0, (1, 2, 3), (0,))])
    assert engine.wait([1])[0].success
    return engine, before


@pytest.mark.parametrize("mode", ["raise", "signal"])
@pytest.mark.parametrize("at", [1, 2])  # the load has two pieces (2 + 1 blocks)
def test_engine_resumes_a_load_whose_scatter_was_interrupted(monkeypatch, mode, at):
    engine, before = engine_with_a_stored_chunk()
    engine.submit_load(2, [GroupTransfer(0, (9, 10, 11), (0,))])
    injector = Injector(monkeypatch, [(pk.ScatterPlan, "__call__")])
    injector.arm(at, mode)
    with interruptible() as caught:
        engine.wait([2])
    injector.disarm()
    assert caught and injector.fired
    assert not any(a.is_deleted() for a in engine.arrays(0))  # the donation was kept
    (result,) = engine.wait([2])  # still in flight: resumed, reported once
    assert result.success
    after = [np.asarray(a) for a in engine.arrays(0)]
    for layer in range(2):
        np.testing.assert_array_equal(after[layer][[9, 10, 11]], before[layer][[1, 2, 3]])
    engine.close()
    assert engine.get_finished() == []


@pytest.mark.parametrize("mode", ["raise", "signal"])
def test_engine_submit_interrupted_while_queueing(monkeypatch, mode):
    engine, _ = engine_with_a_stored_chunk()
    injector = Injector(monkeypatch, [(ThreadPoolExecutor, "submit")])
    injector.arm(1, mode)
    with interruptible() as caught:
        engine.submit_store(2, [GroupTransfer(0, (5,), (1,))])
    injector.disarm()
    assert caught
    # raise: nothing was queued; signal: the job was queued and is reported as usual
    assert engine.knows(2) == (mode == "signal")
    results = engine.get_finished() + (engine.wait([2]) if engine.knows(2) else [])
    engine.close()
    results += engine.get_finished()
    assert [r.job_id for r in results] == ([2] if mode == "signal" else [])
