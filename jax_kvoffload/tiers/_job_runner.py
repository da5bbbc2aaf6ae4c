"""Job queues of a tier: separate load and store threads, a byte bound on queued stores.

A job is a list of keys split into tasks (a task covers a run of keys: one file on disk,
one pipelined batch on a Redis connection). Load tasks go to the load queue, store tasks
to the store queue; each queue has its own threads, so a load never waits behind a
store. A store job that would push the queued store bytes past the bound is dropped at
submission (its future is done at once, `dropped=True`): the engine never waits for a
slow tier. Every job's future completes exactly once, also when the runner closes.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar, overload

from jax_kvoffload._interrupts import deferred_interrupts
from jax_kvoffload._threads import start_threads
from jax_kvoffload.tiers._base import Counters, TierJobResult
from jax_kvoffload.tiers._errors import TIER_THREADS, TierBufferSizeError

__all__ = ["JobRunner", "Task", "byte_runs"]

logger = logging.getLogger(__name__)

# A task gets its thread's state (a staging buffer, a connection) and returns, for each
# of its keys in order, whether it succeeded, plus the payload bytes it moved; or a
# Future of that, when the task's last step runs elsewhere (the disk tier's batched
# fsyncs): its thread takes the next task at once, and the job completes when the
# future does. A third item, a `TierBufferSizeError`, reports a caller's error found
# by the task (a load buffer of the wrong length): the job's future raises the first.
TaskResult = tuple[list[bool], int] | tuple[list[bool], int, TierBufferSizeError | None]
_S = TypeVar("_S")  # a thread's state: what `make_state` builds and each task is given
TaskFn = Callable[[_S], "TaskResult | cf.Future[TaskResult]"]
Task = tuple[int, int, TaskFn[_S]]  # keys [start, stop) of the job, and the work


def _no_state(kind: str) -> None:
    del kind


def _no_close(state: object) -> None:
    del state


class _Job:
    __slots__ = (
        "cost",
        "error",
        "future",
        "keys",
        "kind",
        "lock",
        "nbytes",
        "ok",
        "remaining",
        "start",
    )

    def __init__(self, kind: str, keys: tuple[bytes, ...], ntasks: int, cost: int) -> None:
        self.future: cf.Future[TierJobResult] = cf.Future()
        self.kind = kind
        self.keys = keys
        self.ok = [False] * len(keys)
        self.remaining = ntasks
        self.nbytes = 0
        self.start = time.monotonic()
        self.cost = cost
        self.error: TierBufferSizeError | None = None  # a caller's error, raised at the end
        self.lock = threading.Lock()


class JobRunner(Generic[_S]):
    """Load and store worker threads with their queues, for one tier.

    Args:
      name: thread-name prefix.
      read_threads / write_threads: threads serving the load / store queue.
      max_pending_store_bytes: bound on queued and running store bytes.
      make_state: builds one thread's state, called on that thread with "load"/"store".
      close_state: releases it when the thread ends.
    """

    @overload
    def __init__(
        self: JobRunner[None],
        name: str,
        read_threads: int,
        write_threads: int,
        max_pending_store_bytes: int,
        counters: Counters,
    ) -> None: ...
    @overload
    def __init__(
        self,
        name: str,
        read_threads: int,
        write_threads: int,
        max_pending_store_bytes: int,
        counters: Counters,
        make_state: Callable[[str], _S],
        close_state: Callable[[_S], None] = ...,
    ) -> None: ...
    def __init__(
        self,
        name: str,
        read_threads: int,
        write_threads: int,
        max_pending_store_bytes: int,
        counters: Counters,
        # No make_state: a `JobRunner[None]` (the first overload), whose state is None.
        make_state: Callable[[str], _S] = _no_state,  # type: ignore[assignment]
        close_state: Callable[[_S], None] = _no_close,
    ) -> None:
        self._counters = counters
        self._limit = max_pending_store_bytes
        self._make_state = make_state
        self._close_state = close_state
        self._cond = threading.Condition()
        self._queues: dict[str, deque[tuple[_Job, Task[_S]]]] = {"load": deque(), "store": deque()}
        self._pending_store_bytes = 0
        self._inflight = 0
        self._stop = False
        self._threads = [
            threading.Thread(target=self._work, args=(kind,), name=f"{name}-{kind}{i}", daemon=True)
            for kind, n in (("load", read_threads), ("store", write_threads))
            for i in range(n)
        ]
        # Set by each thread on its way out. close() waits on these, not on Thread.join:
        # a join interrupted by Ctrl-C marks a running thread as stopped on CPython 3.11
        # (it releases the thread's state lock), so a second join would return at once
        # while the thread still runs its last task.
        self._exited = {t.name: threading.Event() for t in self._threads}
        start_threads(self._threads, stop=self._stop_started, **TIER_THREADS)

    def _stop_started(self, started: list[threading.Thread]) -> None:
        """Ends the threads that started before one could not (the constructor fails)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in started:
            self._exited[t.name].wait()
            t.join()

    @property
    def pending_store_bytes(self) -> int:
        return self._pending_store_bytes

    def submit(
        self,
        kind: str,
        keys: Sequence[bytes],
        tasks: Sequence[Task[_S]],
        nbytes: int,
        *,
        accept: Callable[[], bool] = lambda: True,
    ) -> cf.Future[TierJobResult]:
        """Queues a job; a store over the byte bound (or refused by `accept`) is dropped.

        Ctrl-C on the main thread is held while the job is queued and delivered once it
        is: a job is queued whole, with its bytes and its count, or not at all. An
        interrupt delivered that way still leaves the job running (its future completes;
        only the caller never got it); callers that must own the future hold the signal
        around the call as well (the offloader does).
        """
        keys, tasks = tuple(keys), list(tasks)
        cost = nbytes if kind == "store" else 0
        job = _Job(kind, keys, len(tasks), cost)
        with deferred_interrupts(), self._cond:
            if self._stop:
                return self._done_now(job, dropped=kind == "store")
            if kind == "store":
                over = self._pending_store_bytes and self._pending_store_bytes + cost > self._limit
                if over or not accept():
                    self._counters.add(stores_dropped=1, keys_dropped=len(keys))
                    return self._done_now(job, dropped=True)
            if not tasks:
                return self._done_now(job, dropped=False, ok=True)
            self._queues[kind].extend((job, t) for t in tasks)
            self._pending_store_bytes += cost
            self._inflight += 1
            self._cond.notify_all()
        return job.future

    @staticmethod
    def _done_now(job: _Job, *, dropped: bool, ok: bool = False) -> cf.Future[TierJobResult]:
        n = len(job.keys)
        job.future.set_result(TierJobResult(job.kind, job.keys, (ok,) * n, dropped=dropped))
        return job.future

    def drain(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._inflight == 0, timeout)

    def close(self) -> None:
        """Running tasks finish; queued ones fail; threads are joined."""
        with self._cond:
            self._stop = True
            queued = [item for q in self._queues.values() for item in q]
            for q in self._queues.values():
                q.clear()
            self._cond.notify_all()
        for job, (start, stop, _fn) in queued:
            self._finish_task(job, start, [False] * (stop - start), 0)
        for t in self._threads:
            self._exited[t.name].wait()  # running tasks finish (bounded I/O)
            t.join()  # the thread is past its last line

    def _work(self, kind: str) -> None:
        state: _S | None = None
        try:
            state = made = self._make_state(kind)
            queue = self._queues[kind]
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or queue)
                    if self._stop:
                        return
                    job, (start, stop, fn) = queue.popleft()
                try:
                    result = fn(made)
                except BaseException as e:  # SystemExit too: the thread serves the next task
                    self._finish_checked(job, start, stop, e)
                    continue
                if isinstance(result, cf.Future):
                    result.add_done_callback(
                        functools.partial(self._finish_checked, job, start, stop)
                    )
                else:
                    self._finish_checked(job, start, stop, result)
        finally:
            try:
                if state is not None:
                    self._close_state(state)
            finally:
                self._exited[threading.current_thread().name].set()

    def _finish_checked(
        self,
        job: _Job,
        start: int,
        stop: int,
        result: TaskResult | cf.Future[TaskResult] | BaseException,
    ) -> None:
        """Finishes a task from what it returned: a result, a done future of one, or the
        exception it raised (logged and counted; its keys failed)."""
        try:
            if isinstance(result, cf.Future):
                result = result.result()
            if isinstance(result, BaseException):
                raise result
            oks, moved, *error = result
            if len(oks) != stop - start or len(error) > 1:  # a bug in the tier, not I/O
                raise AssertionError(f"task returned {len(oks)} results for {stop - start}")
        except BaseException:  # any failure of a task (a bug too): its keys failed
            logger.exception("tier %s task failed; its %d keys failed", job.kind, stop - start)
            self._counters.add(errors=1)
            oks, moved, error = [False] * (stop - start), 0, []
        self._finish_task(job, start, oks, moved, error[0] if error else None)

    def _finish_task(
        self,
        job: _Job,
        start: int,
        oks: list[bool],
        moved: int,
        error: TierBufferSizeError | None = None,
    ) -> None:
        with job.lock:
            job.ok[start : start + len(oks)] = oks
            job.nbytes += moved
            job.remaining -= 1
            last = job.remaining == 0
            if job.error is None:
                job.error = error
        if not last:
            return
        result = TierJobResult(
            job.kind,
            job.keys,
            tuple(job.ok),
            nbytes=job.nbytes,
            seconds=time.monotonic() - job.start,
        )
        with self._cond:
            self._pending_store_bytes -= job.cost
            self._inflight -= 1
            self._cond.notify_all()
        if job.error is not None:
            job.error.result = result
            job.future.set_exception(job.error)
        else:
            job.future.set_result(result)


def byte_runs(sizes: list[int], limit: int) -> list[tuple[int, int]]:
    """`[start, end)` runs of consecutive items of at most `limit` bytes each (at least
    one item per run), so one job spreads over a tier's threads and each moves a large
    batch."""
    out, start, acc = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and acc + n > limit:
            out.append((start, i))
            start, acc = i, 0
        acc += n
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out
