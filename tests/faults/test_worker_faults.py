"""Failures inside the worker threads, and a pool with no free row.

A worker failure of any kind (an OSError, MemoryError, even a KeyboardInterrupt or
SystemExit raised in that thread) ends its job as failed, reported once; a failed
store is never readable and gives its rows back; a failed load leaves every block
outside its targets untouched; the next jobs run normally.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.faults._helpers import (
    Gate,
    WorkerFaults,
    blocks,
    config,
    expected,
    hashes,
    offloader,
    pins,
    write_blocks,
)

ERRORS = [OSError("disk on fire"), MemoryError("host"), KeyboardInterrupt(), SystemExit(3)]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_a_store_failing_in_the_worker_is_reported_and_never_readable(monkeypatch, error):
    off = offloader()
    faults = WorkerFaults(monkeypatch)
    h = hashes("a", 4)
    write_blocks(off, [1, 2, 3, 4], h)
    faults.arm(error)
    (result,) = off.wait([off.store(h, [1, 2, 3, 4])])
    assert not result.success and type(error).__name__ in result.error
    assert off.lookup(h) == 0 and pins(off) == (0, 0)
    assert off.wait([off.store(h, [1, 2, 3, 4])])[0].success  # the rows came back
    assert off.wait([off.load(h, [10, 11, 12, 13])])[0].success
    np.testing.assert_array_equal(blocks(off, [10, 11, 12, 13]), expected(h))
    off.close()


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_a_load_failing_in_the_worker_leaves_the_caches(monkeypatch, error):
    off = offloader()
    faults = WorkerFaults(monkeypatch)
    h = hashes("a", 4)
    write_blocks(off, [1, 2, 3, 4], h)
    assert off.wait([off.store(h, [1, 2, 3, 4])])[0].success
    before = [np.asarray(a).copy() for a in off.caches()]
    faults.arm(error)
    (result,) = off.wait([off.load(h, [10, 11, 12, 13])])
    assert not result.success
    for a, b in zip(off.caches(), before, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert pins(off) == (0, 0) and off.lookup(h) == 4
    assert off.wait([off.load(h, [10, 11, 12, 13])])[0].success
    np.testing.assert_array_equal(blocks(off, [10, 11, 12, 13]), expected(h))
    off.close()


def test_a_pool_with_no_free_row_drops_offers_until_one_frees(monkeypatch):
    off = offloader(config(chunks=1))
    assert off.num_chunks == 1
    a, b = hashes("a", 2), hashes("b", 2)
    write_blocks(off, [1, 2, 3, 4], a + b)
    # The only row is write-pending: nothing else can be stored.
    gate = Gate(monkeypatch, type(off._pool), "write_blocks")
    store = off.store(a, [1, 2])
    assert gate.entered.wait(10)
    assert off.store(b, [3, 4]) is None
    gate.open()
    assert off.wait([store])[0].success
    # Now it is pinned by a load: still nothing.
    load = off.load(a, [10, 11])
    assert off.store(b, [3, 4]) is None
    assert off.wait([load])[0].success
    np.testing.assert_array_equal(blocks(off, [10, 11]), expected(a))
    # Idle: b evicts a.
    assert off.wait([off.store(b, [3, 4])])[0].success
    assert off.lookup(a) == 0 and off.lookup(b) == 2
    assert pins(off) == (0, 0)
    off.close()
