"""Errors of the secondary tiers (input errors of their configuration live in
`jax_kvoffload.config`: `TierConfigError`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict

from jax_kvoffload.errors import KVOffloadStateError, KVOffloadValueError

if TYPE_CHECKING:
    from jax_kvoffload.tiers._base import TierJobResult


class TierStateError(KVOffloadStateError):
    """A tier cannot start or serve in the current state of the machine."""


class TierClosedError(TierStateError):
    """A call on a tier after `close()`."""


class UnsafeDirectoryError(TierStateError):
    """The disk tier's directory is not private to this user (another owner, group or
    other access, a symbolic link, not a directory); the message gives the fix."""


class DirectIOUnavailableError(TierStateError):
    """`direct_io="on"` but the filesystem refuses O_DIRECT."""


class TierKeyError(KVOffloadValueError):
    """A key or payload passed to a tier is malformed (not bytes, too long, wrong size)."""


class TierBufferSizeError(TierKeyError):
    """A load's `out` buffer is not the length of the payload its key holds: a caller's
    error (or an engine of another geometry sharing the namespace), not a bad entry.
    The entry (its header names this key and namespace and agrees with its size; the
    payload's CRC is checked when a buffer of its length reads it) is kept; the key is
    a miss. The job's future raises
    it once every key of the job has finished; `result` is the job's `TierJobResult`
    (the other keys' outcomes)."""

    result: TierJobResult | None = None  # the job's TierJobResult, set before the future raises


def buffer_size_error(index: int, got: int, stored: int, where: str) -> TierBufferSizeError:
    """The error of a load whose `items[index]` buffer has `got` bytes for a stored
    payload of `stored` bytes."""
    return TierBufferSizeError(
        f"items[{index}] buffer has {got} bytes, but the entry stored under its key in "
        f"{where} holds a payload of {stored} bytes (its header checks out: kept); pass a "
        f"buffer of {stored} bytes, or check that engines sharing this tier use the same "
        "geometry (their namespaces should then differ)"
    )


# How a tier says it cannot start a thread (`jax_kvoffload._threads.start_threads`).
class ThreadErrorArgs(TypedDict):
    """The keyword arguments of `start_threads` that say who failed and how to fix it."""

    error: Callable[[str], BaseException]
    owner: str
    fix: str


TIER_THREADS: ThreadErrorArgs = {
    "error": TierStateError,
    "owner": "the tier",
    "fix": "give the tier fewer read/write threads",
}
