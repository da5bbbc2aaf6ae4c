"""Starting a component's threads, and the one way of saying the process is out of them.

`threading.Thread.start` raises `RuntimeError: can't start new thread` when the process
may not make another (a container's pids limit, `ulimit -u`). A component that starts
threads in its constructor then stops the ones already running (`stop`) and raises its
own state error naming the thread, the cause and the fix. Every layer may import this
module (it imports nothing of ours; the caller gives its error class).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

__all__ = ["start_threads"]


def start_threads(
    threads: Sequence[threading.Thread],
    *,
    error: Callable[[str], BaseException],
    owner: str,
    fix: str = "",
    stop: Callable[[list[threading.Thread]], None] | None = None,
) -> None:
    """Starts `threads` in order. If one cannot start, calls `stop(started)` with those
    that did (it ends them and undoes what the caller set up for them) and raises
    `error(message)`.

    Args:
      threads: threads not started yet.
      error: the exception class (or factory) to raise, e.g. `TierStateError`.
      owner: who the threads belong to, for the message ("the tier").
      fix: what the user can change besides the limit, e.g. "give the tier fewer
        read/write threads".
      stop: ends the threads that started and undoes the caller's set-up (omit when
        there is nothing to undo).
    """
    started: list[threading.Thread] = []
    for thread in threads:
        try:
            thread.start()
        except RuntimeError as e:
            if stop is not None:
                stop(started)
            also = f", or {fix}" if fix else ""
            raise error(
                f"cannot start {owner}'s thread {thread.name!r}: {e}; the process is out of "
                f"threads (a container's pids limit, ulimit -u): raise the limit{also}"
            ) from None
        started.append(thread)
