"""The transfer package's errors: a malformed job, and a call the engine cannot take now."""

from __future__ import annotations

from jax_kvoffload.errors import KVOffloadStateError, KVOffloadValueError

__all__ = ["TransferError", "TransferStateError"]


class TransferError(KVOffloadValueError):
    """A job was malformed (unknown group, chunk out of range, ...); nothing was queued."""


class TransferStateError(KVOffloadStateError):
    """The engine cannot take the call now (closed, used from two threads at once, ...)."""
