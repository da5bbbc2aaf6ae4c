"""`StoreWorker` under Ctrl-C and malformed save specs: every load and save is reported
once, the scheduler side's pins and write-pending chunks are given back, and the next
step works. Fast, without tpu-inference: the worker is driven with their metadata's
fields on plain objects, its stats fed to our `StoreManager` as their scheduler does.

Before the fixes: a Ctrl-C while the load waited left the job in flight, never
reported (its chunks stayed pinned), and its later completion scattered into the
runner's arrays behind its back (donating them: the runner's caches were deleted); a
Ctrl-C during the load's scatter lost its report the same way. A save spec whose blocks
and chunks did not pair raised out of the step after the earlier requests' saves were
submitted, the bad request's chunks (and every later request's) write-pending for good.
"""

from __future__ import annotations

import os
import signal
import threading
from types import SimpleNamespace as NS

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload.bridge.tpu_inference import _worker
from jax_kvoffload.bridge.tpu_inference._hub import Hub
from jax_kvoffload.bridge.tpu_inference._manager import StoreManager
from jax_kvoffload.bridge.tpu_inference._worker import StoreWorker
from jax_kvoffload.config import host_tier_config
from jax_kvoffload.store import HostStore

main_thread_only = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="needs the main thread"
)
H = [bytes([i]) * 32 for i in range(8)]
CHUNKS = 6


class Stats:
    """Their `KVOffloadConnectorStats`' calls the worker makes."""

    def __init__(self):
        self.saves, self.loads = [], []

    def record_save(self, req, saved_chunk_ids):
        self.saves.append((req, list(saved_chunk_ids)))

    def record_load(self, req, loaded_chunk_ids):
        self.loads.append((req, list(loaded_chunk_ids)))

    def is_empty(self):
        return not (self.saves or self.loads)

    def clone_and_reset(self):
        out = NS(saves=self.saves, loads=self.loads)
        self.saves, self.loads = [], []
        return out


class Connector:
    def __init__(self):
        self.meta = []

    def _get_connector_metadata(self):
        return NS(requests_meta=self.meta)


class Setup:
    """A worker, its runner, and the scheduler side's manager over the same store."""

    def __init__(self, seed):
        rng = np.random.default_rng(seed)
        shape = pk.rpa_cache_shape(8, 4, 2, 128, jnp.bfloat16)
        bits = [rng.integers(0, 1 << 16, shape, dtype=np.uint16) for _ in range(2)]
        self.hub = Hub(host=host_tier_config({}), num_chunks=CHUNKS)
        self.hub.store = HostStore(CHUNKS)
        self.manager = StoreManager(self.hub)
        self.conn = Connector()
        self.worker = StoreWorker(self.hub, self.conn, Stats(), "m", 4)
        self.runner = NS(kv_caches=[jnp.asarray(b.view(jnp.bfloat16)) for b in bits])
        self.worker.register_runner(self.runner)

    def bits(self):
        return [np.asarray(a).view(np.uint16).copy() for a in self.runner.kv_caches]

    def report(self):
        """The scheduler's `update_connector_output`: the stats the worker reports."""
        self.hub.engine.join()
        self.worker.get_finished()
        stats = self.worker.get_kv_connector_stats()
        for _, ids in stats.saves if stats else ():
            self.manager.mark_completion(ids, "save")
        for _, ids in stats.loads if stats else ():
            self.manager.mark_completion(ids, "load")
        return stats

    def save(self, req, hashes, blocks):
        chunks, _ = self.manager.allocate_for_save(hashes)
        spec = NS(
            skip_save=False,
            is_final_save=False,
            src_blocks=list(blocks),
            dst_chunks=[c.chunk_id for c in chunks],
        )
        return NS(req_id=req, load_spec=None, save_spec=spec)

    def load(self, req, hashes, blocks):
        chunks = self.manager.prepare_load(hashes)  # pins them, as their scheduler does
        spec = NS(can_load=True, dst_blocks=list(blocks), src_chunks=[c.chunk_id for c in chunks])
        return NS(req_id=req, save_spec=None, load_spec=spec)

    def saved(self, hashes, blocks):
        """Saves `blocks` under `hashes` and waits until the scheduler side has them."""
        self.conn.meta = [self.save("s", hashes, blocks)]
        self.worker.start_load_kv()
        self.worker.start_save_kv()
        self.report()

    def assert_bits(self, before):
        """Every byte of the runner's arrays is as it was (`bits()` taken before)."""
        for got, want in zip(self.bits(), before, strict=True):
            np.testing.assert_array_equal(got, want)

    @property
    def pinned_or_pending(self):
        store = self.hub.store
        return store.num_occupied_chunks - store.num_evictable_chunks


def _check_next_step_works(s, saved_bits):
    """A load of H[0:2] into blocks 5, 6 and a save of block 7, after whatever came
    before: the blocks hold the saved bits, and the scheduler side ends with no pin."""
    s.conn.meta = [s.load("again", H[:2], [5, 6]), s.save("new", [H[5]], [7])]
    s.worker.start_load_kv()
    s.worker.start_save_kv()
    for got, want in zip(s.bits(), saved_bits, strict=True):
        np.testing.assert_array_equal(got[5:7], want[1:3])
    stats = s.report()
    assert [r for r, _ in stats.loads] == ["again"] and [r for r, _ in stats.saves] == ["new"]
    assert s.pinned_or_pending == 0
    s.hub.close()


@main_thread_only
@pytest.mark.parametrize("inline", [False, True], ids=["load_thread", "inline"])
def test_ctrl_c_while_a_load_waits_cancels_it_and_gives_its_pins_back(monkeypatch, inline):
    # A small load reads its rows inline (`INLINE_LOAD_BYTES`), with SIGINT held: Ctrl-C
    # then arrives as the load is recorded and cancels it as in the load thread's wait.
    if not inline:
        monkeypatch.setattr(_worker, "INLINE_LOAD_BYTES", -1)
    s = Setup(0)
    saved_bits = s.bits()
    s.saved(H[:2], [1, 2])
    before = s.bits()
    s.conn.meta = [s.load("a", H[:2], [5, 6])]
    assert s.pinned_or_pending == 2
    copies = s.worker._engine._copies
    fetch, running, released = copies.fetch, threading.Event(), threading.Event()

    threads = []

    def slow_fetch(plan, load, **kw):  # a slow host -> device copy, running when Ctrl-C comes
        threads.append(threading.current_thread().name)
        running.set()
        released.wait(10)
        fetch(plan, load, **kw)

    monkeypatch.setattr(copies, "fetch", slow_fetch)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    threading.Timer(0.6, released.set).start()  # the copy ends after the interrupt
    with pytest.raises(KeyboardInterrupt):
        s.worker.start_load_kv()
    timer.join()
    assert running.is_set()
    assert (threads == ["MainThread"]) is inline, threads
    released.set()
    # Cancelled: it never writes its blocks, and the runner's arrays stay alive (before:
    # its later completion donated them, and every read raised "Array has been deleted").
    stats = s.report()
    assert stats.loads == [("a", [0, 1])]  # reported once: the pins are given back
    assert s.pinned_or_pending == 0
    s.assert_bits(before)
    assert s.report() is None  # nothing reported twice
    _check_next_step_works(s, saved_bits)


@main_thread_only
def test_ctrl_c_while_a_load_is_submitted_cancels_it_too(monkeypatch):
    # Held while the load is submitted and recorded, Ctrl-C arrives as that step ends:
    # the load is cancelled as in a wait (it was not, when the step was outside the
    # wait's handler: its later completion donated the runner's arrays).
    s = Setup(3)
    saved_bits = s.bits()
    s.saved(H[:2], [1, 2])
    before = s.bits()
    s.conn.meta = [s.load("a", H[:2], [5, 6])]
    engine = s.worker._engine
    submit = engine.submit_load

    def interrupted_submit(*args, **kwargs):
        submit(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(engine, "submit_load", interrupted_submit)
    with pytest.raises(KeyboardInterrupt):
        s.worker.start_load_kv()
    monkeypatch.setattr(engine, "submit_load", submit)
    stats = s.report()
    assert stats.loads == [("a", [0, 1])] and s.pinned_or_pending == 0
    s.assert_bits(before)
    _check_next_step_works(s, saved_bits)


@main_thread_only
def test_ctrl_c_during_a_loads_scatter_finishes_it_and_reports_it(monkeypatch):
    s = Setup(1)
    saved_bits = s.bits()
    s.saved(H[:2], [1, 2])
    s.conn.meta = [s.load("a", H[:2], [5, 6])]
    copies = s.worker._engine._copies
    scatter = copies.scatter

    def interrupted_scatter(load):  # Ctrl-C arrives while the blocks are written
        os.kill(os.getpid(), signal.SIGINT)
        return scatter(load)

    monkeypatch.setattr(copies, "scatter", interrupted_scatter)
    with pytest.raises(KeyboardInterrupt):
        s.worker.start_load_kv()
    monkeypatch.setattr(copies, "scatter", scatter)
    for got, want in zip(s.bits(), saved_bits, strict=True):  # finished, written back
        np.testing.assert_array_equal(got[5:7], want[1:3])
    stats = s.report()
    assert stats.loads == [("a", [0, 1])]  # before: never reported, the pins held
    assert s.pinned_or_pending == 0
    _check_next_step_works(s, saved_bits)


@pytest.mark.parametrize("bad", [([3, 4], 1), ([3], 2)], ids=["more_blocks", "more_chunks"])
def test_a_save_spec_whose_blocks_and_chunks_do_not_pair_fails_that_request_only(bad):
    # Their (non-batched) worker logs a request whose save it cannot plan and saves the
    # others; this one also reports the bad request's chunks, failed, so that the
    # scheduler side frees them instead of keeping them write-pending.
    s = Setup(2)
    saved_bits = s.bits()
    blocks, hashes = bad
    a = s.save("a", [H[0]], [1])
    b = s.save("b", H[1 : 1 + hashes], blocks)
    c = s.save("c", [H[3]], [2])
    s.conn.meta = [a, b, c]
    s.worker.start_load_kv()
    s.worker.start_save_kv()
    stats = s.report()
    assert sorted(r for r, _ in stats.saves) == ["a", "b", "c"]
    assert s.pinned_or_pending == 0  # nothing write-pending: b's chunks were freed
    assert s.manager.lookup([H[0]]) == 1 and s.manager.lookup([H[3]]) == 1
    assert s.manager.lookup([H[1]]) == 0  # never served: it holds no block
    s.conn.meta = [s.load("x", [H[0], H[3]], [5, 6])]
    s.worker.start_load_kv()
    for got, want in zip(s.bits(), saved_bits, strict=True):
        np.testing.assert_array_equal(got[5:7], want[1:3])
    s.report()
    assert s.pinned_or_pending == 0
    s.hub.close()


def test_the_host_pool_follows_the_caches_platform(monkeypatch):
    """host_pool "auto" is the pinned pool on a TPU (the D2H copies are the rows): the
    worker tells build_host_pool where the caches live (it said nothing before, so a TPU
    engine got numpy rows and a host copy per block)."""
    from jax_kvoffload.bridge.tpu_inference import _worker
    from jax_kvoffload.transfer import GroupCaches

    seen = {}
    real = _worker.build_host_pool

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(_worker, "build_host_pool", spy)
    Setup(0)
    assert seen.get("accelerator") is False, seen  # CPU arrays
    monkeypatch.setattr(GroupCaches, "on_accelerator", property(lambda self: True))
    Setup(0)
    assert seen.get("accelerator") is True, seen
