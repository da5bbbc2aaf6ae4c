"""What a transfer job asks and how it ended: its direction, each group's part, its result."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from jax_kvoffload.transfer._medium import Medium, TransferPath

__all__ = ["Direction", "GroupTransfer", "TransferResult", "describe_error"]


class Direction(enum.Enum):
    STORE = "store"  # device -> host
    LOAD = "load"  # host -> device

    @property
    def path(self) -> TransferPath:
        """The media this direction moves bytes between."""
        if self is Direction.STORE:
            return TransferPath(Medium.DEVICE, Medium.HOST)
        return TransferPath(Medium.HOST, Medium.DEVICE)


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

    @property
    def path(self) -> TransferPath:
        """device -> host (a store) or host -> device (a load)."""
        return self.direction.path


def describe_error(error: BaseException | str | None) -> str | None:
    """A job's failure as `TransferResult.error` gives it: `"TypeName: message"`."""
    if error is None or isinstance(error, str):
        return error
    return f"{type(error).__name__}: {error}"
