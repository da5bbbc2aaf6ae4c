"""The job core both worker engines run their jobs on (transfer/_job_core.py).

Narrated scenarios with two or three lanes and work that waits on events: completion
order (as each job ends, or FIFO per lane as vLLM's handlers), the wait on shared rows
across directions, failures of every kind ending as failed jobs, a finish step that an
interrupt cuts short, close with and without completing, and each job's own time.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from jax_kvoffload.transfer import Direction
from jax_kvoffload.transfer.internals import JobCore

LANES = {"store": Direction.STORE, "load": Direction.LOAD, "expedited": Direction.LOAD}


class Tally:
    def __init__(self) -> None:
        self.records: list[tuple[bool, bool, int]] = []

    def record(self, store: bool, success: bool, size_bytes: int, seconds: float) -> None:
        self.records.append((store, success, size_bytes))


def result(job, error, seconds):
    return (job.job_id, error, seconds)


def core(**kw) -> JobCore:
    return JobCore(LANES, result, **kw)


def ids(results) -> list[int]:
    return [r[0] for r in results]


def held(gate: threading.Event, log: list | None = None, name: object = None):
    def work() -> None:
        assert gate.wait(10), "gate never opened"
        if log is not None:
            log.append(name)

    return work


@pytest.mark.parametrize("fifo", [True, False])
def test_fifo_lanes_report_in_submission_order_others_as_each_job_ends(fifo):
    jobs, gate = core(fifo=fifo), threading.Event()
    jobs.submit(1, "store", held(gate), 10)  # the store lane's head, still running
    jobs.fail(2, "store", MemoryError("device memory exhausted"), 20)  # ended at once
    jobs.submit(3, "load", lambda: None, 30)  # another lane's head
    jobs.join([3])
    assert jobs.has_finished()
    # FIFO (vLLM's handlers): 2 waits behind 1 in its lane; otherwise it is reported now.
    assert ids(jobs.collect()) == ([3] if fifo else [2, 3])
    assert jobs.in_flight(1) and jobs.in_flight(2) == fifo
    gate.set()
    jobs.join()
    assert ids(jobs.collect()) == ([1, 2] if fifo else [1])
    assert not jobs.has_finished() and jobs.num_in_flight == 0
    jobs.close()


def test_a_host_copy_waits_for_earlier_jobs_of_the_other_direction_on_its_rows():
    jobs, gate, log = core(), threading.Event(), []
    jobs.submit(1, "store", held(gate, log, "store rows 1-2"), 10, rows=frozenset({1, 2}))
    jobs.submit(2, "load", lambda: log.append("load row 2"), 10, rows=frozenset({2}))
    jobs.submit(3, "expedited", lambda: log.append("load row 7"), 10, rows=frozenset({7}))
    jobs.join([3])
    assert log == ["load row 7"]  # rows of its own: it did not wait
    gate.set()
    jobs.join()
    assert log == ["load row 7", "store rows 1-2", "load row 2"]
    assert sorted(ids(jobs.collect())) == [1, 2, 3]
    jobs.close()


@pytest.mark.parametrize("error", [ValueError("bad row"), KeyboardInterrupt(), SystemExit(3)])
def test_any_failure_in_a_worker_thread_ends_the_job_as_failed_and_is_counted(error):
    tally = Tally()
    jobs = core(tally=tally)

    def work() -> None:
        raise error

    jobs.submit(1, "load", work, 64)
    jobs.submit(2, "store", lambda: None, 32)
    (failed,) = jobs.wait([1])
    assert failed[1] is error
    assert ids(jobs.wait([2])) == [2]
    assert tally.records == [(False, False, 64), (True, True, 32)]
    jobs.close()


def test_a_thread_that_cannot_start_fails_the_job_and_an_interrupt_queues_nothing(
    monkeypatch,
):
    jobs = core()

    def no_thread(self, *args, **kwargs):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(ThreadPoolExecutor, "submit", no_thread)
    jobs.submit(1, "store", lambda: None, 10)  # accepted: reported failed
    (r,) = jobs.wait([1])
    assert isinstance(r[1], RuntimeError)

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ThreadPoolExecutor, "submit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        jobs.submit(2, "store", lambda: None, 10)
    assert not jobs.knows(2)  # nothing was queued: nothing to report
    monkeypatch.undo()
    jobs.close()
    assert jobs.collect() == []


def test_an_interrupted_finish_leaves_the_job_in_flight_and_the_next_collect_resumes_it():
    calls, released = [], []

    def finish(job):
        calls.append(job.job_id)
        if len(calls) == 1:
            raise KeyboardInterrupt  # e.g. Ctrl-C between two scatter pieces
        return None

    jobs = core(finish=finish, release=lambda job: released.append(job.job_id))
    jobs.submit(1, "load", lambda: None, 10)
    jobs.join()
    with pytest.raises(KeyboardInterrupt):
        jobs.collect()
    assert jobs.in_flight(1) and released == []
    assert ids(jobs.collect()) == [1]  # reported once, released once
    assert (calls, released, jobs.collect()) == ([1, 1], [1], [])
    jobs.close()


def test_a_discarded_job_behind_a_running_one_never_runs_and_is_reported_once():
    jobs, gate, ran = core(), threading.Event(), []
    jobs.submit(1, "store", held(gate), 10)
    jobs.submit(2, "store", lambda: ran.append(2), 10)
    assert jobs.discard(2) and not jobs.discard(99)
    gate.set()
    results = jobs.wait([1, 2])
    assert results[1][1].startswith("discarded")
    assert ran == [] and jobs.collect() == []
    jobs.close()


def test_close_without_completing_keeps_the_results_for_collect():
    tally = Tally()
    jobs, gate = core(fifo=True, tally=tally), threading.Event()
    jobs.submit(1, "store", held(gate), 10)
    threading.Timer(0.05, gate.set).start()
    jobs.close(complete=False)  # waited for the job; vLLM collects it later
    assert jobs.closing and jobs.closed and tally.records == []
    assert ids(jobs.collect()) == [1] and tally.records == [(True, True, 10)]
    jobs.close()  # idempotent


def test_a_jobs_time_is_its_own_not_the_wait_until_it_is_collected():
    jobs = core()
    jobs.submit(1, "load", lambda: time.sleep(0.05), 10)
    jobs.join()
    time.sleep(0.3)  # the caller collects late
    ((_, error, seconds),) = jobs.collect()
    assert error is None and 0.05 <= seconds < 0.3
    jobs.close()
