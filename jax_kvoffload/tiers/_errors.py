"""Errors of the secondary tiers (input errors of their configuration live in
`jax_kvoffload.config`: `TierConfigError`)."""

from __future__ import annotations

from jax_kvoffload.errors import KVOffloadStateError, KVOffloadValueError


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
