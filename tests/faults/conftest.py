"""Fixtures of the fault suite: a bound on every test, and a check that it leaked no
transfer thread or file descriptor."""

from __future__ import annotations

import faulthandler
import sys

import pytest

from tests.faults._helpers import kv_threads, open_fds

HANG_BOUND_S = 120  # a test of this suite takes seconds; past this it hangs: fail loudly


@pytest.fixture(autouse=True)
def bounded_and_leak_free():
    threads, fds = kv_threads(), open_fds()
    # Nothing may hang past a bound: dump every thread's stack and end the run.
    faulthandler.dump_traceback_later(HANG_BOUND_S, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
    leaked = kv_threads() - threads
    assert not leaked, f"transfer threads left running: {sorted(t.name for t in leaked)}"
    assert open_fds() <= fds, f"file descriptors leaked: {fds} -> {open_fds()}"
