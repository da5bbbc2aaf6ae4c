"""Copy streams and events of the torch worker, and their synchronous stand-in on CPU.

On CUDA each lane of the worker (store, load, expedited load, as vLLM's three handlers)
enqueues its copies on a stream of its own, after an event recorded on the caller's
current stream when the job was submitted (so the copies read and write the blocks
after the engine's pending work, without stalling the engine's thread or stream); the
job ends when the event recorded after its copies completes. Elsewhere the same calls
run on `SyncStream`: copies are done when issued, events are complete when recorded (a
non-CUDA accelerator synchronizes its device at the submit event instead).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    import torch

__all__ = ["CopyStream", "DoneEvent", "SyncStream", "copy_stream", "submit_event"]


class CopyEvent(Protocol):
    """What the worker asks of an event (`torch.cuda.Event` has these)."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class CopyStream(Protocol):
    """What the worker asks of a copy stream."""

    def issue(self) -> contextlib.AbstractContextManager[torch.cuda.Stream | None]: ...

    def wait(self, event: CopyEvent | None) -> None: ...

    def record(self) -> CopyEvent: ...


class DoneEvent:
    """An event that completed when it was recorded (the stand-in's)."""

    __slots__ = ()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class SyncStream:
    """The stand-in stream: every copy issued on it is done when issued."""

    def issue(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def wait(self, event: CopyEvent | None) -> None:
        if event is not None:
            event.synchronize()

    def record(self) -> CopyEvent:
        return DoneEvent()


class CudaStream:
    """A CUDA stream of the worker's own, on the tensors' device."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self._torch = torch
        self.stream = torch.cuda.Stream(device=device)

    @contextlib.contextmanager
    def issue(self) -> Iterator[torch.cuda.Stream]:
        """Makes the stream current: copies and allocations inside go on it."""
        with self._torch.cuda.stream(self.stream):
            yield self.stream

    def wait(self, event: CopyEvent | None) -> None:
        if event is not None:
            self.stream.wait_event(cast("torch.cuda.Event", event))  # made by `record`

    def record(self) -> CopyEvent:
        event = self._torch.cuda.Event()
        event.record(self.stream)
        return event


def copy_stream(device: torch.device) -> CopyStream:
    """A copy stream for `device`: its own CUDA stream, or the stand-in."""
    if device.type == "cuda":
        return CudaStream(device)
    return SyncStream()


def submit_event(device: torch.device) -> CopyEvent | None:
    """Recorded on the caller's current stream at submit: the copies of the job wait
    for it. None on CPU (torch ops there are synchronous); a non-CUDA accelerator is
    synchronized instead (untested on hardware)."""
    if device.type == "cpu":
        return None
    import torch

    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event
    torch.accelerator.synchronize(device)
    return None
