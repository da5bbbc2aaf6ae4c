"""Interrupt safety, in one place: Ctrl-C held for a step, and one caller at a time.

CPython raises `KeyboardInterrupt` between any two bytecodes of the main thread. Where
that would split a step that must happen whole (a job registered and queued; a donated
scatter and the assignment of its result; a result taken from the engine and recorded
in the store; pins taken and the job that will drop them recorded), the step runs
inside `deferred_interrupts()`: SIGINT is held and delivered again (to whatever handler
was installed) as soon as the block ends, so Ctrl-C still interrupts the caller, one
consistent step later.

Who holds it (docs/architecture.md, "Interrupts"): the public entry points
(`KVOffloader`'s methods) and the job cores: `transfer/_job_core.py` for both worker
engines (a job's registration, and its completion with its finish step) and
`tiers/_job_runner.py` for the tiers (a job queued whole). The layers they call (the
job book, the tier path, the load plan, the copies) are plain code, run only inside
such a block or on a worker thread. Blocking
waits never run inside a block: the entry points wait first (interruptibly, changing
nothing) and then take the step.

`SingleCaller` makes the objects that are driven from one thread say so when a second
thread calls in while the first is still inside (instead of corrupting their maps).

Imports nothing of ours: every layer may use it (tests/test_layering.py).
"""

from __future__ import annotations

import signal
import threading

__all__ = ["DeferredInterrupts", "SingleCaller", "deferred_interrupts"]

_state = threading.local()

# `signal.getsignal` / `signal.signal` wrap the C functions of `_signal` and turn each
# handler they return into a `Handlers` member by trying `Handlers(handler)`: on CPython
# 3.11 that raises and catches a ValueError for every Python handler, ~15 us a call on
# the CI VM, ~100 us per block below (three calls), as much as a small vLLM worker job
# costs in all. The C functions take and return the same handlers, without it.
try:
    from _signal import getsignal as _getsignal
    from _signal import signal as _setsignal
except ImportError:  # not CPython
    _getsignal, _setsignal = signal.getsignal, signal.signal


def deferred_interrupts() -> DeferredInterrupts:
    """Holds SIGINT until the block ends (main thread only; nested blocks are free)."""
    return DeferredInterrupts()


class DeferredInterrupts:
    """The context manager of `deferred_interrupts()`.

    A class, not a `contextlib.contextmanager` generator: the generator's setup and
    teardown cost ~10 us a block on the CI VM, paid twice by every worker job.
    """

    __slots__ = ("_previous", "_received")

    def __enter__(self) -> None:
        self._previous = None
        # Python runs signal handlers on the main thread only: other threads need nothing.
        if getattr(_state, "deferring", False) or threading.current_thread() is not (
            threading.main_thread()
        ):
            return
        previous = _getsignal(signal.SIGINT)
        if previous is None:  # installed outside Python: it could not be put back
            return
        received: list[int] = []
        self._received = received
        _setsignal(signal.SIGINT, lambda signum, frame: received.append(signum))
        self._previous = previous
        _state.deferring = True

    def __exit__(self, *exc: object) -> None:
        if self._previous is None:
            return
        _state.deferring = False
        _setsignal(signal.SIGINT, self._previous)
        if self._received:
            signal.raise_signal(signal.SIGINT)  # now delivered to the original handler


class SingleCaller:
    """Enter with `with guard:` at every public entry of an object driven by one thread.

    A call that arrives while another call is inside (from a second thread, or from a
    signal handler that interrupted the first) raises `error` instead of running on
    half-updated maps. Cheap: two C calls per entry, one per exit.

    Ctrl-C never leaves it held. Its exit is the lock's own C `__exit__` (stored in the
    `__exit__` slot, which `with` looks up on the type and binds to the instance), so no
    bytecode (and no signal check) runs between the body's end and the release: a
    Python `__exit__` took `KeyboardInterrupt` at its first bytecode, before it released
    the lock, and every later call was refused (a SIGINT storm on `with guard: pass` got
    it stuck at the first interrupt). An interrupt raised inside `__enter__` just after
    the acquire releases what this thread owns before it propagates.
    """

    __slots__ = ("__exit__", "_error", "_lock", "_what")

    def __init__(self, what: str, error: type[Exception]) -> None:
        # An RLock only for `_is_owned()`: a second entry by the owning thread (a signal
        # handler inside a call) is refused before the acquire, as any other is.
        self._lock = threading.RLock()
        self._what = what
        self._error = error
        self.__exit__ = self._lock.__exit__

    def __enter__(self) -> None:
        lock = self._lock
        try:
            entered = not lock._is_owned() and lock.acquire(blocking=False)  # type: ignore[attr-defined]  # C RLock
        except BaseException:  # interrupted between the acquire and here: give it back
            if lock._is_owned():  # type: ignore[attr-defined]
                lock.release()
            raise
        if not entered:
            raise self._error(
                f"{self._what} was called from thread {threading.current_thread().name!r} "
                "while another call is inside it (another thread, or a signal handler): it "
                "is driven from one thread at a time; call it from the engine's thread, or "
                "serialise the calls with a lock"
            )
