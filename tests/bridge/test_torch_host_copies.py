"""The vLLM torch worker's host copies, counted by its pool (`pool.host_copies`), on the
code path an accelerator takes (`dma=True`, forced on CPU; its streams are the
synchronous stand-in there): a move as wide as its slots is copied by the copy engine
straight between the device and the slots, and the CPU copies none of its bytes; a
narrower move, and the CPU-tensor and gather-kernel paths, copy each byte exactly once
per direction (docs/vllm.md, "Data path"). Jobs end when the event after their copies
completes."""

from __future__ import annotations

import threading
from types import SimpleNamespace as Spec

import numpy as np
import pytest
import torch

from jax_kvoffload.bridge import _torch_worker
from jax_kvoffload.bridge._torch_streams import SyncStream
from jax_kvoffload.bridge.torch import JobSpecError, TorchKVWorker
from jax_kvoffload.hostmem import HostChunkPool, PinnedRowPool

NB, PAGE = 12, 64


def device_spec(ids, sizes=None):
    return Spec(block_ids=ids, group_sizes=sizes, block_indices=None)


def worker(refs, **kw):
    cache = torch.randint(0, 256, (NB, PAGE), dtype=torch.uint8)
    return cache, TorchKVWorker([(cache, PAGE)], refs, blocks_per_chunk=2, num_chunks=6, **kw)


def store_then_load(w, gpu, cpu, targets, sizes=None):
    assert w.submit_store(1, device_spec(gpu, sizes), Spec(block_ids=cpu))
    w.wait([1])
    stored = w.pool.host_copies.snapshot()
    assert w.submit_load(2, Spec(block_ids=cpu), device_spec(targets, sizes))
    w.wait([2])
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True), (2, True)]
    return stored, w.pool.host_copies.snapshot()


@pytest.mark.parametrize("runs", ["one run", "scattered chunks"])
def test_the_copy_engine_path_copies_nothing_with_the_cpu(runs):
    cache, w = worker([[(0, PAGE)]], dma=True)
    before = cache.clone()
    cpu = [1, 2] if runs == "one run" else [4, 0]  # slots 2..5 in one run, or two runs
    stored, loaded = store_then_load(w, [7, 1, 3, 9], cpu, [0, 2, 5, 11])
    assert stored == (0, 0) and loaded == (0, 0)
    assert torch.equal(cache[[0, 2, 5, 11]], before[[7, 1, 3, 9]])
    w.shutdown()


@pytest.mark.parametrize(
    "kw", [{"dma": False}, {"store_kernel": True}], ids=["cpu tensors", "gather kernel"]
)
def test_the_other_paths_copy_each_byte_once_per_direction(kw):
    cache, w = worker([[(0, 48)]], **kw)
    before = cache.clone()
    stored, loaded = store_then_load(w, [7, 1, 3], [3, 5], [0, 2, 5])
    n = 3 * 48
    assert stored == (n, 0) and loaded == (n, n)
    assert torch.equal(cache[[0, 2, 5], :48], before[[7, 1, 3], :48])
    assert torch.equal(cache[:, 48:], before[:, 48:])  # padding never written
    w.shutdown()


def test_a_move_narrower_than_its_slots_is_copied_once_by_the_cpu():
    # Two groups on one tensor: the slots hold the wider page (48 bytes); the other
    # group's 32-byte pages cannot be one DMA per run (the slots' other bytes stay).
    cache, w = worker([[(0, 48)], [(0, 32)]], dma=True)
    before = cache.clone()
    stored, loaded = store_then_load(w, [7, 1, 3, 9], [0, 4], [0, 2, 5, 11], sizes=[2, 2])
    assert stored == (2 * 32, 0)  # group 1's two blocks; group 0's: none
    assert loaded == (2 * 32, 2 * 32)
    assert torch.equal(cache[[0, 2], :48], before[[7, 1], :48])
    assert torch.equal(cache[[5, 11], :32], before[[3, 9], :32])
    assert torch.equal(cache[[5, 11], 32:], before[[5, 11], 32:])
    w.shutdown()


class GatedStream(SyncStream):
    """The stand-in, but its events complete only when the test opens the gate."""

    def __init__(self, gate):
        self.gate, self.issued = gate, 0

    def issue(self):
        self.issued += 1
        return super().issue()

    def record(self):
        gate = self.gate

        class Event:
            def synchronize(self):
                gate.wait(10)

            def query(self):
                return gate.is_set()

        return Event()


def test_a_job_is_reported_when_its_event_completes(monkeypatch):
    gate, streams = threading.Event(), []

    def gated(device):
        streams.append(GatedStream(gate))
        return streams[-1]

    monkeypatch.setattr(_torch_worker, "copy_stream", gated)
    _, w = worker([[(0, PAGE)]], dma=True)
    assert w.submit_store(1, device_spec([3, 4]), Spec(block_ids=[2]))
    threading.Event().wait(0.2)
    assert w.get_finished() == []  # copies issued, event not complete: not reported
    assert sum(s.issued for s in streams) == 1  # issued on a stream of the worker's own
    gate.set()
    w.wait([1])
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, True)]
    w.shutdown()


def test_a_given_numpy_pool_takes_the_copy_engine_path_too():
    # A shared region's pool (JaxOffloadingSpec's workers): its slots are the memory
    # the copy engine writes (page-locked once where CUDA is; here plain memory).
    pool = HostChunkPool(6, {0: PAGE}, 2)
    cache, w = worker([[(0, PAGE)]], dma=True, pool=pool)
    before = cache.clone()
    assert store_then_load(w, [7, 1], [5], [0, 2]) == ((0, 0), (0, 0))
    assert torch.equal(cache[[0, 2]], before[[7, 1]])
    w.shutdown()
    with pytest.raises(JobSpecError, match="HostChunkPool"):
        worker([[(0, PAGE)]], dma=True, pool=PinnedRowPool(6, {0: PAGE}, 2))
    with pytest.raises(JobSpecError, match="store_kernel"):
        worker([[(0, PAGE)]], dma=True, store_kernel=True)


def test_page_lock_registers_each_contiguous_range_once(monkeypatch, caplog):
    from jax_kvoffload.bridge import _torch_dma

    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size))
            return 0 if size != 8 * 2 * 3 else 1  # refuses one size: logged, skipped

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", Cudart)
    buffer = np.zeros(HostChunkPool.nbytes_for(3, {0: 16, 1: 32}, 2), np.uint8)
    carved = HostChunkPool(3, {0: 16, 1: 32}, 2, buffer=buffer)  # groups back to back
    assert _torch_dma.page_lock(carved) == [buffer.ctypes.data]
    assert calls == [("register", buffer.ctypes.data, buffer.nbytes)]
    calls.clear()
    separate = HostChunkPool(3, {0: 16, 1: 8}, 2)  # one allocation per group
    with caplog.at_level("WARNING"):
        locked = _torch_dma.page_lock(separate)
    assert sorted(c[2] for c in calls) == [48, 96]  # not adjacent: one range each
    assert locked == [separate.flat(0).ctypes.data]  # the 48-byte group was refused
    assert "could not page-lock 48 bytes" in caplog.text
    calls.clear()
    _torch_dma.page_unlock(locked)
    assert calls == [("unregister", locked[0])]


def test_a_submit_event_that_fails_fails_its_job_and_only_it(monkeypatch):
    def broken(device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    _, w = worker([[(0, PAGE)]], dma=True)
    monkeypatch.setattr(_torch_worker, "submit_event", broken)
    assert w.submit_store(1, device_spec([3]), Spec(block_ids=[2]))
    monkeypatch.undo()
    assert w.submit_store(2, device_spec([4]), Spec(block_ids=[1]))
    w.wait([1, 2])
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(1, False), (2, True)]
    w.shutdown()


@pytest.mark.parametrize("dma", [True, False])
def test_a_bad_max_staging_bytes_is_refused_at_construction(dma):
    # Before: accepted, and every job then failed in the worker thread (TypeError).
    from jax_kvoffload.errors import KVOffloadTypeError

    for bad, err in (("abc", KVOffloadTypeError), (None, KVOffloadTypeError), (-5, JobSpecError)):
        with pytest.raises(err, match="max_staging_bytes"):
            worker([[(0, PAGE)]], dma=dma, max_staging_bytes=bad)
