"""Ctrl-C landing inside a tier's `JobRunner.submit`: every job is queued whole (its
bytes and its count with it, its future completed exactly once) or not at all. Before,
an interrupt between counting a store's bytes and queueing it left the bytes counted
for good (every later store past the bound was dropped) and `drain()` never true."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from jax_kvoffload.tiers._base import Counters
from jax_kvoffload.tiers._job_runner import JobRunner

pytestmark = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="needs the main thread"
)


def runner(limit=1000):
    return JobRunner("test-jobs", 1, 1, limit, Counters())


def ok_task(start, stop):
    return (start, stop, lambda state: ([True] * (stop - start), 10))


class InterruptingTasks(list):
    """A task list whose iteration delivers a real SIGINT (as Ctrl-C would, there)."""

    def __iter__(self):
        os.kill(os.getpid(), signal.SIGINT)
        return super().__iter__()


def test_an_interrupt_while_the_tasks_are_queued_leaks_nothing():
    r = runner(limit=100)
    try:
        with pytest.raises(KeyboardInterrupt):
            r.submit("store", [b"k1"], InterruptingTasks([ok_task(0, 1)]), 60)
        assert r.drain(5)  # before: never (a job counted in flight, queued nowhere)
        assert r.pending_store_bytes == 0  # before: 60 bytes counted for good
        f = r.submit("store", [b"k2"], [ok_task(0, 1)], 60)
        assert not f.result(5).dropped and f.result(5).ok == (True,)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        r.close()


def test_an_interrupt_inside_the_queueing_is_delivered_after_it_and_the_job_completes():
    r = runner()
    seen = []

    def accept():  # called while the job is being queued
        os.kill(os.getpid(), signal.SIGINT)
        return True

    def task(state):
        seen.append(1)
        return [True], 10

    try:
        with pytest.raises(KeyboardInterrupt):
            r.submit("store", [b"k1"], [(0, 1, task)], 60, accept=accept)
        assert r.drain(5) and seen == [1]  # queued whole: it ran once and completed
        assert r.pending_store_bytes == 0
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        r.close()


def test_submit_from_another_thread_needs_no_signal_handling():
    r = runner()
    out = []
    try:
        t = threading.Thread(
            target=lambda: out.append(r.submit("load", [b"k"], [ok_task(0, 1)], 0))
        )
        t.start()
        t.join()
        assert out[0].result(5).ok == (True,)
    finally:
        r.close()
