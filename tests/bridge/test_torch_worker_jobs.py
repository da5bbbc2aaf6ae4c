"""The torch worker's jobs on the shared job core: what it gained from the JAX engine's.

A worker thread that cannot start fails the job it was for (reported, like every
other failure) instead of raising out of `submit_*` with the job half recorded; and an
ended job is freed at once, not kept alive by a reference cycle until the cyclic
collector runs (its host staging with it).
"""

from __future__ import annotations

import gc
import types
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jax_kvoffload.bridge.torch import TorchKVWorker  # noqa: E402


def spec(ids, sizes=None, starts=None):
    return types.SimpleNamespace(
        block_ids=np.asarray(ids, dtype=np.int64), group_sizes=sizes, block_indices=starts
    )


def worker() -> TorchKVWorker:
    cache = torch.arange(64, dtype=torch.uint8).reshape(4, 16)
    return TorchKVWorker([(cache, 16)], [[(0, 16)]], blocks_per_chunk=1, num_chunks=4)


def test_a_thread_that_cannot_start_fails_the_job_and_reports_it(monkeypatch):
    w = worker()

    def no_thread(self, *args, **kwargs):
        raise RuntimeError("can't start new thread")

    try:
        monkeypatch.setattr(ThreadPoolExecutor, "submit", no_thread)
        assert w.submit_store(1, spec([1], [1], [0]), spec([2]))
        assert w.submit_load(2, spec([2]), spec([3], [1], [0]), expedited=True)
        monkeypatch.undo()
        assert w.submit_load(3, spec([2]), spec([0], [1], [0]))  # threads start again
        w.wait([1, 2, 3])
        results = [(r.job_id, r.success) for r in w.get_finished()]
        assert sorted(results) == [(1, False), (2, False), (3, True)]
        store, load = w.transfer_totals()
        assert (store.jobs_failed, load.jobs_failed, load.jobs_completed) == (1, 1, 1)
    finally:
        monkeypatch.undo()
        w.shutdown()


def test_ended_jobs_are_freed_without_the_cyclic_collector():
    w = worker()
    gc.collect()
    before = {id(o) for o in gc.get_objects() if type(o) is Future}
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for job in range(1, 7):
            if job % 2:
                w.submit_store(job, spec([job % 4], [1], [0]), spec([job % 4]))
            else:
                w.submit_load(job, spec([(job - 1) % 4]), spec([job % 4], [1], [0]))
            w.wait([job])
            assert [r.success for r in w.get_finished()] == [True]
        w.shutdown()  # a thread that just ended a job may hold it until its next one
        alive = [o for o in gc.get_objects() if type(o) is Future and id(o) not in before]
    finally:
        if was_enabled:
            gc.enable()
    assert alive == []
