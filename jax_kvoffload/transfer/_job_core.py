"""The job core of both worker engines: jobs, lanes, completion order, timing, tally.

`TransferEngine` (JAX caches, _engine.py) and the vLLM bridge's torch worker
(bridge/_torch_worker.py) differ only in what a store and a load do to bytes. Everything
else about their jobs is here, once:

- **Submission.** A job is registered under its id and queued on its *lane*: one worker
  thread (`kv-<lane>`) per lane, each lane moving one `Direction`. The JAX engine has a
  store and a load lane; the torch worker, like vLLM's three handlers, a store, a load
  and an expedited-load lane. A job whose data path failed before it could be queued
  (`fail`) is accepted and reported failed like any other.
- **Rows shared across directions.** A job's worker part first waits for every earlier
  job of the other direction that touches one of its host chunk rows (`rows`), and for
  any futures the caller names (`after`): after a reset, a new store may be handed the
  row an old load still reads.
- **Completion order.** `fifo=False`: a job is completed as soon as its worker part
  ended (in submission order among those that ended; the JAX engine). `fifo=True`: each
  lane completes in submission order, a job waiting for the earlier ones of its lane to
  be completed first (vLLM's handlers; the torch worker).
- **Every job reported exactly once**, whatever happens: a failure in a worker thread,
  even `KeyboardInterrupt` or `SystemExit`, ends the job as failed; a discarded job ends
  as failed; an interrupt on the caller's thread leaves each job either registered and
  reported as usual, or not registered at all (`deferred_interrupts` holds SIGINT for
  the few lines that register a job, and for its completion: its `finish` step and
  the move from in flight to reported); `close` completes or keeps every job in
  flight. The engines' data paths hold no signal themselves.
- **Timing and tally.** A job's time is its own: from `started` to the end of its worker
  part, plus the engine's `finish` step (a JAX load's scatter), never the wait until the
  caller collected it (vLLM times the copies themselves). Each completed job is counted
  in the engine's `tally`.

The engine keeps its data path, its argument checks and errors, and the shape of its
results (`make_result`); the core never logs. Calls come from the engine's caller thread
(the engine guards them); the worker threads touch only their jobs' futures.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from jax_kvoffload._interrupts import deferred_interrupts
from jax_kvoffload.transfer._job_types import Direction

__all__ = ["DISCARDED", "EngineJob", "JobCore", "JobError", "Tally"]

DISCARDED = "discarded by the caller before it completed"

R = TypeVar("R")
# Why a job failed: the exception of its worker part or its finish step, or a reason.
JobError = BaseException | str | None


class Tally(Protocol):
    """Counts reported jobs (`jax_kvoffload.stats.TransferTally` is one)."""

    def record(self, store: bool, success: bool, size_bytes: int, seconds: float) -> None: ...


class EndTime:
    """When a job's worker part ended, set by `run_job` just before its future is.

    Its own object, not the job: a done callback bound to the job made job and future a
    reference cycle (job.future -> callback -> job), so every finished job, and
    a load's staging with it (the size of the job), outlived its completion until the
    cyclic collector ran: dead 512 MiB loads piled up (+384 MiB resident each), and
    faulting in each load's fresh staging cost ~25x the kernel time; loads ran at half
    their speed on CPU (docs/benchmarks.md, "Offload and load").
    """

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at: float | None = None

    def mark(self) -> None:
        self.at = time.perf_counter()


@dataclass(slots=True)
class EngineJob:
    """One job in flight. `payload` is the data path's own state (a JAX load's pieces,
    filled by the worker and scattered by `finish`); the core never reads it."""

    job_id: int
    lane: str
    direction: Direction
    future: Future[None]
    started: float
    size_bytes: int
    rows: frozenset[int] = frozenset()
    payload: object = None
    discarded: bool = False
    end: EndTime = field(default_factory=EndTime)

    @property
    def ended(self) -> float | None:
        """When its worker part ended (None while it runs or if it never ran)."""
        return self.end.at


def run_job(
    future: Future[None], end: EndTime, after: list[Future[Any]], work: Callable[[], None]
) -> None:
    """A job's worker part: waits for the earlier jobs that share its rows, then works.
    Its end is marked before its future is set: whoever sees the future done sees it."""
    if not future.set_running_or_notify_cancel():
        return  # cancelled before it started (discarded, or its submit was interrupted)
    try:
        if after:
            wait_futures(after)
        work()
    except BaseException as exc:  # every failure, even SystemExit, ends as a failed job
        end.mark()
        future.set_exception(exc)
    else:
        end.mark()
        future.set_result(None)


def wait_for(futures: Iterable[Future[Any]]) -> None:
    """Blocks until every future is done; interruptible (a lock wait), never raises
    their exceptions. Cheaper than `concurrent.futures.wait`, which locks every future
    and installs a waiter on each (measured: 10-30 us more per job on the CI VM)."""
    for future in futures:
        if not future.done():
            with contextlib.suppress(CancelledError):
                future.exception()


class JobCore(Generic[R]):
    """The jobs of one worker engine, from submission to their reported results.

    Args:
      lanes: lane name -> the direction it moves; one worker thread each, started at
        the lane's first job and named `kv-<lane>`.
      make_result: `(job, error, seconds) -> result`, the engine's result for a job
        that ended (`error` None on success); called once per job, on the caller's
        thread.
      fifo: complete each lane in submission order (vLLM's handlers) instead of each
        job as soon as it ended.
      finish: `job -> error or None`, run on the caller's thread when a job's worker
        part succeeded, before its result is made (a JAX load's scatter), with SIGINT
        held. If it raises (a `BaseException`: a failure returns as the error), the
        job stays in flight and the next completion calls `finish` again (it resumes).
      release: `job -> None`, drops what the job holds (its staging) once it is
        reported, even if a traceback still references it.
      tally: counts each completed job (`Tally`).

    Attributes:
      closing: set by `close`; the engine refuses new jobs from then on.
      closed: `close` has finished (the worker threads are stopped).
    """

    def __init__(
        self,
        lanes: Mapping[str, Direction],
        make_result: Callable[[EngineJob, JobError, float], R],
        *,
        fifo: bool = False,
        finish: Callable[[EngineJob], BaseException | None] | None = None,
        release: Callable[[EngineJob], None] | None = None,
        tally: Tally | None = None,
    ) -> None:
        self._lanes = dict(lanes)
        self._make_result = make_result
        self._fifo = fifo
        self._finish = finish
        self._release = release
        self._tally = tally
        self._threads = {
            lane: ThreadPoolExecutor(1, thread_name_prefix=f"kv-{lane}") for lane in self._lanes
        }
        self._pending: dict[int, EngineJob] = {}  # in flight, by submission
        self._done: dict[int, R] = {}  # completed, not yet collected
        self.closing = False
        self.closed = False

    # -- what the engine asks ----------------------------------------------------------

    def in_flight(self, job_id: int) -> bool:
        """Whether the job's worker part or its completion is outstanding."""
        return job_id in self._pending

    def knows(self, job_id: int) -> bool:
        """Whether the job will be (or can now be) collected."""
        return job_id in self._pending or job_id in self._done

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    def has_finished(self) -> bool:
        """Whether `collect` would return anything now (never blocks)."""
        if self._done:
            return True
        if self._fifo:
            return bool(self._ended())
        return any(j.future.done() for j in self._pending.values())

    # -- submitting (caller's thread) ----------------------------------------------------

    def submit(
        self,
        job_id: int,
        lane: str,
        work: Callable[[], None],
        size_bytes: int,
        *,
        rows: frozenset[int] = frozenset(),
        after: Sequence[Future[Any]] = (),  # any result: only their end is waited for
        started: float | None = None,
        payload: object = None,
        inline: bool = False,
    ) -> None:
        """Queues a job's worker part `work` on `lane`; the job is registered iff this
        returns, or if an interrupt arrives once its work is already running (then
        `knows(job_id)` says so). `started` defaults to now.

        `inline`: when the job has nothing to wait for and no earlier job of its lane
        is still running, run `work` here, on the caller's thread and with SIGINT held,
        instead of on the lane (for a small job the caller waits for next: two thread
        handoffs fewer, ~0.1-0.4 ms each on the 2-core CI VM). It ends as a lane's job
        does: its failure is the job's."""
        direction = self._lanes[lane]
        waits = [
            j.future
            for j in (self._pending.values() if rows else ())
            if j.direction is not direction and not rows.isdisjoint(j.rows)
        ]
        waits += after
        future: Future[None] = Future()
        if started is None:
            started = time.perf_counter()
        job = EngineJob(job_id, lane, direction, future, started, size_bytes, rows, payload)
        with deferred_interrupts():
            self._pending[job_id] = job
            # Not past an earlier job of the lane still running or queued: the lane runs
            # its jobs in order, and a load overtaking an earlier one to the same blocks
            # would be scattered first, then overwritten by the older bytes.
            if inline and not waits and not self._lane_busy(lane, job_id):
                run_job(future, job.end, [], work)  # never raises: it ends the job
                return
            try:
                self._threads[lane].submit(run_job, future, job.end, waits, work)
            except BaseException as exc:  # on any exit: queued and registered, or neither
                if not future.cancel():
                    raise  # it runs already: it stays in flight and is reported (`knows`)
                if not isinstance(exc, Exception):
                    del self._pending[job_id]  # interrupted: nothing was queued
                    raise
                # e.g. no thread could start: the job is accepted and ends as failed
                job.future = Future()
                job.end.mark()
                job.future.set_exception(exc)

    def _lane_busy(self, lane: str, job_id: int) -> bool:
        """Whether a job of `lane` other than `job_id` has not ended yet."""
        return any(
            j.lane == lane and j.job_id != job_id and not j.future.done()
            for j in self._pending.values()
        )

    def fail(
        self,
        job_id: int,
        lane: str,
        error: BaseException,
        size_bytes: int,
        *,
        started: float | None = None,
    ) -> None:
        """Registers a job that failed before it could be queued (e.g. its gather ran
        out of device memory): it is reported failed like any job of its lane."""
        future: Future[None] = Future()
        if started is None:
            started = time.perf_counter()
        job = EngineJob(job_id, lane, self._lanes[lane], future, started, size_bytes)
        job.end.mark()
        future.set_exception(error)
        self._pending[job_id] = job

    def discard(self, job_id: int) -> bool:
        """Gives up a job in flight (False if it is not): it ends as failed, and its work
        never runs if it has not started. It is still reported once."""
        job = self._pending.get(job_id)
        if job is None:
            return False
        job.discarded = True
        if job.future.cancel():
            job.end.mark()  # it never ran: it ended now
        return True

    # -- completing (caller's thread) ----------------------------------------------------

    def collect(self) -> list[R]:
        """Completes the jobs that ended (in the core's order); returns every result not
        yet collected and forgets them."""
        for job in self._ended():
            self._complete(job)
        out = list(self._done.values())
        self._done.clear()
        return out

    def join(self, job_ids: Iterable[int] | None = None) -> None:
        """Blocks until the worker parts of the given jobs (default: all) ended, without
        completing them; ids not in flight are skipped. Interruptible."""
        if job_ids is None:
            futures = [j.future for j in self._pending.values()]
        else:
            futures = [self._pending[i].future for i in job_ids if i in self._pending]
        wait_for(futures)

    def wait(self, job_ids: Sequence[int]) -> list[R]:
        """Blocks until the given jobs end, completes them, and returns their results in
        the given order. Every id must be known (`knows`) and listed once."""
        self.join(job_ids)
        for i in job_ids:
            job = self._pending.get(i)
            if job is not None:
                self._complete(job)
        return [self._done.pop(i) for i in job_ids]

    def close(self, *, complete: bool = True) -> None:
        """Refuses new jobs (`closing`), waits for every job in flight, completes them
        (`complete`; else they stay for `collect`), then stops the worker threads.

        The jobs' own futures, not the threads' joins, say when the work has ended: a
        join interrupted by Ctrl-C marks a running thread stopped on CPython 3.11.
        Idempotent; if interrupted while waiting, call it again.
        """
        if self.closed:
            return
        self.closing = True
        wait_for([j.future for j in self._pending.values()])
        if complete:
            for job in list(self._pending.values()):
                self._complete(job)
        for pool in self._threads.values():
            pool.shutdown(wait=True)
        self.closed = True

    def _ended(self) -> list[EngineJob]:
        """The jobs to complete now, in order."""
        if not self._fifo:
            return [j for j in self._pending.values() if j.future.done()]
        jobs, out = list(self._pending.values()), []
        for lane in self._lanes:
            for job in jobs:
                if job.lane != lane:
                    continue
                if not job.future.done():
                    break  # the lane's later jobs wait for this one
                out.append(job)
        return out

    def _complete(self, job: EngineJob) -> None:
        """Ends a job whose worker part is done: `finish`, then its result is recorded.

        One step under `deferred_interrupts`: a finish that donates buffers (a JAX
        load's scatter) keeps its results, and a finished job is recorded, whatever
        Ctrl-C does meanwhile (it arrives once the job is recorded). An exception out
        of `finish` (one injected in its place) leaves the job in flight: the next
        completion calls `finish` again, which resumes.
        """
        error: JobError
        if job.discarded:
            error = DISCARDED
        else:
            try:
                error = job.future.exception()
            except CancelledError:
                error = "cancelled before it started"
        with deferred_interrupts():
            finish_started = time.perf_counter()
            if error is None and self._finish is not None:
                error = self._finish(job)
            # The job's own time: its worker part, then its finish step; not the time it
            # waited for the caller to collect it.
            now = time.perf_counter()
            ended = now if job.ended is None else job.ended + (now - finish_started)
            seconds = ended - job.started
            result = self._make_result(job, error, seconds)
            del self._pending[job.job_id]
            self._done[job.job_id] = result
            if self._tally is not None:
                self._tally.record(
                    job.direction is Direction.STORE, error is None, job.size_bytes, seconds
                )
            if self._release is not None:
                self._release(job)
