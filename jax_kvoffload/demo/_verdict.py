"""Whether a demo run did its job, and if not, why: per tier and overall (no jax here).

A demo asked to show a tier passes only if the tier took every chunk offered to it
(nothing failed or dropped) and, in the reader process, served A's whole prefix. The
tiers themselves fail open (a serving engine recomputes), so without these checks a
Redis server that was never running read as PASS. The reason comes from the counters
and from the first warning the tiers logged about that tier (captured by `TierLog`).
"""

from __future__ import annotations

import logging
import re
import threading
import urllib.parse

__all__ = ["TierLog", "reader_verdict", "tier_verdict"]


class TierLog(logging.Handler):
    """Collects the library's warnings while a demo runs (`with TierLog() as log:`).

    Where nothing else handles them (no logging configured: the command line), each is
    also written to stderr as Python's last-resort handler would have, so attaching
    this handler changes nothing a user sees.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self._lock_messages = threading.Lock()
        self.messages: list[str] = []
        self._source = logging.getLogger("jax_kvoffload")  # listened to: it logs nothing itself
        self._echo = False

    def __enter__(self) -> TierLog:
        self._echo = not self._source.hasHandlers() and logging.lastResort is not None
        self._source.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._source.removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # a bad format string elsewhere: not ours to raise
            return
        with self._lock_messages:
            self.messages.append(text)
        if self._echo and logging.lastResort is not None:
            logging.lastResort.handle(record)

    def about(self, spec: str) -> str | None:
        """The first warning that names the tier of `spec` (its path, host:port or
        socket), or None."""
        # The name whole: a warning about disk:/tmp/ab is not about disk:/tmp/a, nor one
        # about port 63790 about 6379 (a path inside the tier's directory still is).
        needle = re.compile(re.escape(_where(spec)) + r"(?![\w.-])")
        with self._lock_messages:
            return next((m for m in self.messages if needle.search(m)), None)


def _where(spec: str) -> str:
    if spec.startswith("disk:"):
        return spec[5:]
    parts = urllib.parse.urlsplit(spec)
    if parts.scheme == "unix":
        return parts.path
    return parts.netloc.rpartition("@")[2]  # host:port, without credentials


def tier_verdict(spec: str, stats: dict, expected: int, log: TierLog | None) -> dict:
    """`{"passed", "why"}` of one tier that `expected` chunks were offered to."""
    got, failed, dropped = stats["cascaded"], stats["cascade_failed"], stats["cascade_dropped"]
    if got >= expected and not failed and not dropped:
        return {"passed": True, "why": None}
    why = (
        f"tier {spec}: {got} of the {expected} chunks offered reached it "
        f"({failed} failed, {dropped} dropped)"
    )
    return {"passed": False, "why": _with_cause(why, spec, log)}


def reader_verdict(spec: str, stats: dict, hit: int, expected_blocks: int, chunks: int) -> dict:
    """`{"passed", "why"}` of the reader's tier: it served A's whole prefix."""
    promoted = stats["promoted"]
    if hit == expected_blocks and promoted >= chunks:
        return {"passed": True, "why": None}
    return {
        "passed": False,
        "why": f"tier {spec}: B hit {hit} of the {expected_blocks} prefix blocks; the tier "
        f"served {promoted} of {chunks} chunks ({stats['promotion_failed']} failed, "
        f"{stats['promotion_no_room']} without room in the host store)",
    }


def _with_cause(why: str, spec: str, log: TierLog | None) -> str:
    said = log.about(spec) if log is not None else None
    if said is not None:
        return f"{why}: {said}"
    return f"{why}; the tier's warnings (logged once per process) say why"
