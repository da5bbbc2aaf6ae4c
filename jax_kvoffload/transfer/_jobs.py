"""Transfer jobs, their results and errors, and the checks on job arguments."""

from __future__ import annotations

import enum
import operator
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jax_kvoffload.errors import (
    KVOffloadStateError,
    KVOffloadTypeError,
    KVOffloadValueError,
)
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


def check_index(name: str, value: object) -> int:
    """`value` as an int; refuses bools, floats (never truncated) and other types."""
    if isinstance(value, (bool, np.bool_)):
        raise KVOffloadTypeError(f"{name}={value!r} must be an int, not a bool")
    try:
        return operator.index(value)  # ints and numpy integers only: 2.0 is refused
    except TypeError:
        raise KVOffloadTypeError(
            f"{name} must be an int, got {type(value).__name__} {_short(value)}"
        ) from None


def check_indices(name: str, values: object) -> np.ndarray:
    """A sequence (or 1-D array) of ints as int64; floats and bools are refused."""
    if isinstance(values, np.ndarray):
        array = values
    elif isinstance(values, Sequence) and not isinstance(values, (str, bytes, bytearray)):
        # numpy would turn True into 1 silently (and a mix of types into strings).
        if any(type(v) is bool or type(v) is np.bool_ for v in values):
            array = np.asarray(values, dtype=object)
        else:
            try:
                array = np.asarray(values)
            except (TypeError, ValueError, OverflowError):
                array = np.asarray(values, dtype=object)
    else:
        raise KVOffloadTypeError(
            f"{name} must be a sequence of ints, got {type(values).__name__} {_short(values)}"
        )
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1:
        raise KVOffloadValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.dtype.kind == "O":  # huge Python ints, or mixed types: check one by one
        items = [check_index(f"{name}[{i}]", v) for i, v in enumerate(array.tolist())]
        bad = [v for v in items if not -(2**62) <= v < 2**62]
        if bad:
            raise KVOffloadValueError(f"{name} holds {bad[0]}, far outside any cache")
        return np.asarray(items, dtype=np.int64)
    if array.dtype.kind not in "iu":
        first = next(i for i, v in enumerate(array.tolist()) if not _is_int(v))
        raise KVOffloadTypeError(
            f"{name}[{first}]={array.tolist()[first]!r} must be an int "
            f"({name} has dtype {array.dtype}; ids are never truncated)"
        )
    if array.dtype.kind == "u" and array.dtype.itemsize == 8 and int(array.max()) >= 2**63:
        raise KVOffloadValueError(f"{name} holds {int(array.max())}, far outside any cache")
    return array.astype(np.int64, copy=False)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


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
