"""wait() with ids it cannot collect (issue 12, defect 3): refused before anything is
collected, so the good jobs stay reportable, nothing stays pinned or write-pending, and
close() ends cleanly."""

from __future__ import annotations

import pytest

import pallas_kernels as pk
from jax_kvoffload.errors import KVOffloadError
from jax_kvoffload.hostmem import HostChunkPool
from jax_kvoffload.transfer import GroupCaches, GroupTransfer, TransferEngine
from tests.faults._helpers import hashes, noise, offloader, pins, write_blocks


def bad_id_lists(good: int, collected: int) -> list[list]:
    return [
        [good, 999],  # unknown
        [good, good],  # duplicate
        [good, collected],  # already collected
        [999, good],
        [good, "x"],
        [good, 1.0],
    ]


def test_offloader_wait_refuses_bad_ids_without_losing_the_good_job():
    off = offloader()
    h = hashes("a", 4)
    write_blocks(off, [1, 2, 3, 4], h)
    collected = off.store(h[:2], [1, 2])
    assert off.wait([collected])[0].success
    store = off.store(h, [1, 2, 3, 4])  # the second chunk only
    load = off.load(h[:2], [10, 11])
    for good in (store, load):
        for ids in bad_id_lists(good, collected):
            with pytest.raises((KVOffloadError, TypeError, ValueError)):
                off.wait(ids)
    results = off.wait([store, load])
    assert [r.job_id for r in results] == [store, load]
    assert all(r.success for r in results)
    assert pins(off) == (0, 0)
    assert off.lookup(h) == 4  # the store was recorded: readable
    assert off.close() == []


def test_offloader_close_after_refused_waits_stops_the_threads():
    off = offloader()
    h = hashes("a", 2)
    write_blocks(off, [1, 2], h)
    job = off.store(h, [1, 2])
    with pytest.raises(KVOffloadError):
        off.wait([job, job + 100])
    results = off.close()  # conftest checks the threads are gone
    assert [r.job_id for r in results] == [job] and results[0].success


def test_engine_wait_refuses_bad_ids_without_collecting_any():
    gc = GroupCaches(noise(), pk.KVLayout.nhd())
    with TransferEngine({0: gc}, HostChunkPool(4, {0: gc.block_bytes}, 2), backend="xla") as e:
        e.submit_store(1, [GroupTransfer(0, (1, 2), (0,))])
        e.submit_store(2, [GroupTransfer(0, (3, 4), (1,))])
        assert e.wait([2])[0].success
        for ids in bad_id_lists(1, 2):
            with pytest.raises((KVOffloadError, TypeError, ValueError)):
                e.wait(ids)
        assert [r.job_id for r in e.wait([1])] == [1]
