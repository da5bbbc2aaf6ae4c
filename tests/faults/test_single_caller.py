"""`SingleCaller` (jax_kvoffload/_interrupts.py): one caller at a time, and never left
held by Ctrl-C.

Before: its `__exit__` was Python code, and CPython checks for signals at a function's
first bytecode, so a Ctrl-C landing as a guarded call returned raised inside `__exit__`
before the lock was released: every later call was refused ("another call is inside
it"): the engine, the offloader or the tpu-inference worker was dead. A SIGINT storm on
a bare guard got it stuck after 2-3 signals; now its exit is the lock's own C
`__exit__`, and thousands of signals leave it usable.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import threading

import pytest

from jax_kvoffload._interrupts import SingleCaller

SCRIPT = pathlib.Path(__file__).with_name("single_caller_storm.py")
ROOT = SCRIPT.parents[2]


class Refused(Exception):
    pass


def test_a_second_entry_from_the_same_thread_is_refused_and_the_guard_recovers():
    guard = SingleCaller("the thing", Refused)
    # The second entry, as a signal handler inside a call would make it:
    with guard, pytest.raises(Refused, match="another call is inside it"), guard:
        pass
    with guard:  # released by the outer exit
        pass


def test_another_thread_is_refused_while_a_call_is_inside():
    guard = SingleCaller("the thing", Refused)
    seen: list[BaseException] = []

    def other():
        try:
            with guard:
                pass
        except Refused as e:
            seen.append(e)

    with guard:
        t = threading.Thread(target=other)
        t.start()
        t.join(10)
    assert seen and "another call is inside it" in str(seen[0])
    t = threading.Thread(target=other)
    t.start()
    t.join(10)
    assert len(seen) == 1  # free again: the second thread got in


def test_an_exception_in_the_body_releases_it():
    guard = SingleCaller("the thing", Refused)
    with pytest.raises(ValueError), guard:
        raise ValueError("boom")
    with guard:
        pass


@pytest.mark.parametrize("kind", ["guard", "engine"])
def test_a_sigint_storm_never_leaves_the_guard_held(kind):
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "2", kind],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    line = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and line.startswith("signals"), done.stdout + done.stderr[-2000:]
    signals = int(line.split()[1])
    assert signals > 50, line  # the storm did run
    assert line.endswith("stuck False"), line
