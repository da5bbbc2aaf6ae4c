"""The torch worker (vLLM's `OffloadingWorker` protocol) under Ctrl-C and garbage.

`shutdown()` waits for running jobs; interrupted there, the next `shutdown()` must still
wait for them before it calls `on_shutdown` (which unmaps a shared host region under the
jobs' feet in the bridge). It used to mark itself shut down first and return at once the
second time. `wait()` with something that is not a collection of job ids is a typed
error of the library's root."""

from __future__ import annotations

import os
import signal
import threading
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jax_kvoffload.bridge.torch import TorchKVWorker  # noqa: E402
from jax_kvoffload.errors import KVOffloadTypeError  # noqa: E402


def spec(ids, sizes=None, starts=None):
    return types.SimpleNamespace(
        block_ids=np.asarray(ids, dtype=np.int64), group_sizes=sizes, block_indices=starts
    )


def worker(**kw) -> TorchKVWorker:
    cache = torch.arange(64, dtype=torch.uint8).reshape(4, 16)
    return TorchKVWorker([(cache, 16)], [[(0, 16)]], blocks_per_chunk=1, num_chunks=4, **kw)


@pytest.mark.parametrize("bad", [None, 5, 1.5, object()])
def test_wait_with_garbage_is_a_typed_error(bad):
    w = worker()
    try:
        with pytest.raises(KVOffloadTypeError, match="job_ids"):
            w.wait(bad)
    finally:
        w.shutdown()


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="needs the main thread"
)
def test_an_interrupted_shutdown_still_waits_for_running_jobs(monkeypatch):
    events: list[str] = []
    write, running, released = TorchKVWorker._write, threading.Event(), threading.Event()

    def slow_write(self, staged):
        running.set()
        released.wait(10)  # a slow host copy, running when shutdown() starts
        write(self, staged)
        events.append("job done")

    monkeypatch.setattr(TorchKVWorker, "_write", slow_write)
    w = worker(on_shutdown=lambda: events.append("on_shutdown"))
    assert w.submit_store(7, spec([1], [1], [0]), spec([2]))
    assert running.wait(10)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        w.shutdown()
    timer.join()
    released.set()
    w.shutdown()  # before: returned at once; on_shutdown never ran
    w.shutdown()
    assert events == ["job done", "on_shutdown"]
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(7, True)]


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="needs the main thread"
)
def test_a_sigint_just_after_a_job_was_queued_loses_no_job(monkeypatch):
    # A real SIGINT right after the worker thread took the job: the job must be recorded
    # before the interrupt is delivered, or it runs and is never reported (it was: the
    # record was made after the thread pool's submit returned).
    from concurrent.futures import ThreadPoolExecutor

    submit = ThreadPoolExecutor.submit

    def submit_then_sigint(self, *args, **kwargs):
        future = submit(self, *args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        return future

    w = worker()
    try:
        monkeypatch.setattr(ThreadPoolExecutor, "submit", submit_then_sigint)
        with pytest.raises(KeyboardInterrupt):
            w.submit_store(7, spec([1], [1], [0]), spec([2]))
        monkeypatch.undo()
        w.wait([7])
        assert [(r.job_id, r.success) for r in w.get_finished()] == [(7, True)]
    finally:
        monkeypatch.undo()
        w.shutdown()
