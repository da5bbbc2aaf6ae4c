"""Transfer jobs and their results."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Direction(enum.Enum):
    STORE = "store"  # device -> host
    LOAD = "load"  # host -> device


@dataclass(frozen=True)
class GroupTransfer:
    """One group's part of a job: device blocks and the host chunks they occupy.

    `block_ids[k]` maps to block slot `first_slot + k` of the chunk list, where slot s is
    block `s % blocks_per_chunk` of chunk `chunk_ids[s // blocks_per_chunk]`; so a list
    may start and end mid-chunk, as vLLM's handler allows.
    """

    group: int
    block_ids: tuple[int, ...]
    chunk_ids: tuple[int, ...]
    first_slot: int = 0


@dataclass(frozen=True)
class TransferResult:
    """How a job ended. `error` says why when `success` is False."""

    job_id: int
    direction: Direction
    success: bool
    size_bytes: int
    seconds: float
    error: str | None = None


class TransferError(ValueError):
    """A job was malformed (unknown group, chunk out of range, ...); nothing was queued."""
