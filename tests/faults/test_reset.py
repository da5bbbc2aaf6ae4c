"""reset_cache() and close() at every stage of a job (issue 12, defect 2).

A reset forgets every chunk, pins included, and the store hands the freed rows to the
next offers at once (the ids must match vLLM's manager). A load still reading such a row
must nevertheless deliver the bytes it was started for: the engine keeps a store's host
write off a row that an earlier load still reads.
"""

from __future__ import annotations

import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload.hostmem import HostChunkPool
from jax_kvoffload.transfer import GroupCaches, GroupTransfer, TransferEngine
from tests.faults._helpers import (
    Gate,
    Reports,
    blocks,
    expected,
    hashes,
    noise,
    offloader,
    pins,
    write_blocks,
)


def stored(off, prefix, src):
    h = hashes(prefix, len(src))
    write_blocks(off, src, h)
    assert off.wait([off.store(h, src)])[0].success
    return h


def test_a_load_in_flight_across_a_reset_delivers_its_own_bytes(monkeypatch):
    off = offloader()
    a = stored(off, "a", [1, 2])  # chunk 0 holds a
    gate = Gate(monkeypatch, type(off._pool), "read_blocks")
    load = off.load(a, [10, 11])
    assert gate.entered.wait(10)  # the load thread is about to read chunk 0
    off.reset_cache()
    b = hashes("b", 2)
    write_blocks(off, [5, 6], b)
    store = off.store(b, [5, 6])  # after the reset, chunk 0 again: b's bytes go there
    gate.open_later(0.2)
    results = {r.job_id: r for r in off.wait([load, store])}
    assert results[load].success and results[store].success
    np.testing.assert_array_equal(blocks(off, [10, 11]), expected(a))
    # b was stored under the new generation and loads back as b.
    assert off.lookup(b) == 2 and off.lookup(a) == 0
    assert off.wait([off.load(b, [20, 21])])[0].success
    np.testing.assert_array_equal(blocks(off, [20, 21]), expected(b))
    assert pins(off) == (0, 0)
    off.close()


def test_engine_keeps_a_store_off_rows_an_earlier_load_reads(monkeypatch):
    arrays = noise(1)
    before = [np.asarray(a).copy() for a in arrays]
    gc = GroupCaches(arrays, pk.KVLayout.nhd())
    pool = HostChunkPool(4, {0: gc.block_bytes}, 2)
    with TransferEngine({0: gc}, pool, backend="xla") as engine:
        engine.submit_store(1, [GroupTransfer(0, (1, 2), (0,))])
        assert engine.wait([1])[0].success
        gate = Gate(monkeypatch, HostChunkPool, "read_blocks")
        engine.submit_load(2, [GroupTransfer(0, (10, 11), (0,))])
        assert gate.entered.wait(10)
        engine.submit_store(3, [GroupTransfer(0, (5, 6), (0,))])  # same row
        gate.open_later(0.2)
        assert all(r.success for r in engine.wait([2, 3]))
        after = [np.asarray(a) for a in engine.arrays(0)]
    for layer in range(2):
        np.testing.assert_array_equal(after[layer][[10, 11]], before[layer][[1, 2]])
    # and the row now holds the second store's bytes
    row = pool.rows(0)[0].view(np.uint16).reshape(2, 2, -1)
    np.testing.assert_array_equal(row[0, 0], before[0][5].ravel())


STAGES = ["queued", "running", "ended", "collected"]


@pytest.mark.parametrize("action", ["reset", "close"])
@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("stage", STAGES)
def test_reset_and_close_at_every_stage_of_a_job(monkeypatch, stage, direction, action):
    """The job is reported once, with the right bytes if it succeeded; nothing stays
    pinned or write-pending; after close, no thread remains (conftest)."""
    off = offloader()
    reports = Reports()
    a = stored(off, "a", [1, 2])
    b = hashes("b", 2)
    write_blocks(off, [3, 4], b)
    method = "write_blocks" if direction == "store" else "read_blocks"
    gate = Gate(monkeypatch, type(off._pool), method, times=2)
    start = (
        (lambda: off.store(b, [3, 4])) if direction == "store" else (lambda: off.load(a, [12, 13]))
    )
    if stage == "queued":  # a first job of the same direction holds the thread
        blocker = reports.issue(
            off.store(hashes("c", 2), [7, 8]) if direction == "store" else off.load(a, [14, 15])
        )
        assert gate.entered.wait(10)
        job = reports.issue(start())
    else:
        job = reports.issue(start())
        if stage == "running":
            assert gate.entered.wait(10)
        else:
            gate.times = 0
            gate.open()
            off._engine.join([job])
            if stage == "collected":
                reports.record(off.wait([job]))
    timer = gate.open_later(0.2)
    if action == "reset":
        off.reset_cache()
        reports.record(off.wait())
        assert off.lookup(a) == 0 and off.lookup(b) == 0
        assert pins(off) == (0, 0)
        # The store works on after the reset.
        c = stored(off, "z", [20, 21])
        assert off.wait([off.load(c, [22, 23])])[0].success
        np.testing.assert_array_equal(blocks(off, [22, 23]), expected(c))
        reports.record(off.close())
    else:
        reports.record(off.close())
        assert pins(off) == (0, 0)
    timer.join()
    reports.check_exactly_once()
    result = reports.results[job]
    assert result.success
    if direction == "load":
        np.testing.assert_array_equal(blocks(off, [12, 13]), expected(a))
    if stage == "queued":
        assert reports.results[blocker].success
