"""Errors of the shared host region (`SharedHostRegion`), in their own module so the
memory and rendezvous helpers beside it can raise them without an import cycle."""

from __future__ import annotations

from jax_kvoffload.errors import KVOffloadStateError, KVOffloadValueError


class SharedRegionError(KVOffloadStateError):
    """The shared host region cannot be created or joined (the message says why and what
    to change). A `RuntimeError`, like every state error of this library."""


class SharedRegionArgumentError(SharedRegionError, KVOffloadValueError):
    """An argument of `SharedHostRegion` is wrong (also a `ValueError`)."""


class SharedRegionTimeoutError(SharedRegionError):
    """A bounded wait ran out: another process of the same user holds the region's
    rendezvous lock or does not answer on its name (stopped, hung, or still reserving a
    large region). `pid` is that process when known."""

    def __init__(self, message: str, *, pid: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid


class ForeignPeerError(SharedRegionError):
    """A process of another user sits on one of the region's rendezvous names. Nothing is
    exchanged with it (no memory is sent to it or taken from it); `uid` and `pid` name it."""

    def __init__(self, message: str, *, uid: int, pid: int) -> None:
        super().__init__(message)
        self.uid = uid
        self.pid = pid
