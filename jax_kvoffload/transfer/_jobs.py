"""Transfer jobs, their results and errors."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jax_kvoffload.errors import KVOffloadStateError, KVOffloadValueError
from jax_kvoffload.transfer._medium import Medium, TransferPath


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


class TransferError(KVOffloadValueError):
    """A job was malformed (unknown group, chunk out of range, ...); nothing was queued."""


class TransferStateError(KVOffloadStateError):
    """The engine cannot take the call now (closed, used from two threads at once, ...)."""


# -- the transfer engine's own records (jax_kvoffload/transfer/_engine.py) ---------------

DISCARDED = "discarded by the caller before it completed"


@dataclass
class EngineJob:
    job_id: int
    direction: Direction
    future: Future
    started: float
    size_bytes: int
    chunks: frozenset[int]
    # Loads: (group, block ids, device staging, host buffers to give back), filled by
    # the worker, scattered in order on the caller's thread; `applied` survives an
    # interrupt between two pieces, so the next completion resumes where it stopped.
    pieces: list[tuple[int, np.ndarray, Any, list[np.ndarray]]] = field(default_factory=list)
    applied: int = 0
    discarded: bool = False
    end: EndTime = field(default_factory=lambda: EndTime())

    @property
    def ended(self) -> float | None:
        """When its worker part ended (None while it runs or if it never ran)."""
        return self.end.at


class EndTime:
    """When a job's worker part ended, set by its future's done callback.

    Its own object, not a method of the job: a callback bound to the job makes job and
    future a reference cycle (job.future -> callback -> job), so every finished job, and
    a load's staging with it (the size of the job), outlived its completion until the
    cyclic collector ran: dead 512 MiB loads piled up (+384 MiB resident each), and
    faulting in each load's fresh staging cost ~25x the kernel time; loads ran at half
    their speed on CPU (docs/benchmarks.md, "Offload and load").
    """

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at: float | None = None

    def mark(self, _: Future) -> None:
        self.at = time.perf_counter()


def run_job(future: Future, after: list[Future], work: Callable[[], None]) -> None:
    """A job's worker part: waits for the earlier jobs that share its rows, then works."""
    if not future.set_running_or_notify_cancel():
        return  # cancelled before it started (its submit was interrupted)
    try:
        if after:
            wait_futures(after)
        work()
    except BaseException as exc:  # every failure, even SystemExit, ends as a failed job
        future.set_exception(exc)
    else:
        future.set_result(None)
