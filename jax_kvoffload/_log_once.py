"""Logging a kind of event at WARNING the first time, at DEBUG after: the one helper for it.

A tier that fails a thousand times a second, or an engine that meets another geometry's
entry at every scheduler step, must not flood the log, and the first occurrence must
still reach an operator. Every layer may import this module (it imports nothing of ours).
"""

from __future__ import annotations

import logging
import threading

__all__ = ["LogOnce", "log_once", "reset_log_once"]


class LogOnce:
    """The kinds of events already logged at WARNING, and the call that logs the next one.

    `log_once` is the process-wide set (a kind warns once per process); an object that
    warns once per instance (a vLLM tier: once per tier) holds its own `LogOnce()`.
    """

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, logger: logging.Logger, kind: str, msg: str, *args: object) -> None:
        """Logs `msg % args` at WARNING if `kind` was not logged before, else at DEBUG."""
        with self._lock:
            first = kind not in self._seen
            self._seen.add(kind)
        logger.log(logging.WARNING if first else logging.DEBUG, msg, *args)

    def reset(self, kind: str) -> None:
        """Lets `kind` log at WARNING again (e.g. a server that recovered and fails anew)."""
        with self._lock:
            self._seen.discard(kind)


log_once = LogOnce()
reset_log_once = log_once.reset
