"""The torch worker's copy-engine path: device blocks <-> host slots, no host memcpy.

The host pool's slots are one allocation (`HostChunkPool` over a buffer; page-locked
once with `cudaHostRegister` when CUDA is there (`page_lock`), ordinary memory on CPU),
so a slot range is a torch view the copy engine writes and reads directly:

- **store**: one gather per move (`index_select` of the blocks' leading bytes, on the
  device, into a staging tensor), then one D2H copy per contiguous run of slots, from
  the staging straight into the slots;
- **load**: one H2D copy per contiguous run of slots, from the slots into a staging
  tensor on the device, then one scatter per move (`index_copy_` into vLLM's own
  tensor).

All of it is issued on the lane's copy stream (`_torch_streams`), after the job's
submit event; the job ends when the event recorded after its copies completes. The CPU
copies nothing: the pool's `host_copies` stays 0 for every move whose width is the
slot's. A move narrower than its slot (a group whose widest page on the tensor is
shorter than another group's) cannot be one DMA per run (the slot's other bytes must
stay): its bytes go through a staging tensor in host memory and `write_blocks` /
`read_blocks`, one host copy per byte, counted (docs/vllm.md, "Data path").
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from jax_kvoffload.bridge._job_plan import TensorMove
from jax_kvoffload.bridge._tensor_bytes import TensorBytes
from jax_kvoffload.bridge._torch_streams import CopyEvent, CopyStream
from jax_kvoffload.hostmem import HostChunkPool

if TYPE_CHECKING:
    import torch

__all__ = ["SlotDMA", "page_lock", "page_unlock", "slot_runs"]

logger = logging.getLogger(__name__)


def page_lock(pool: HostChunkPool) -> list[int]:
    """Page-locks the rows of the pool (the worker's own slots, or a shared region's), so
    that its copies are DMA without the driver's staging; returns the registered
    addresses (`page_unlock` them at shutdown). The groups' rows are registered as one
    range where they touch (CUDA refuses a page registered twice). Best effort: a
    refusal is logged and the copies stay correct, staged by the driver (untested on
    hardware)."""
    import torch

    spans: list[list[int]] = []
    for start, size in sorted(
        (pool.flat(t).ctypes.data, pool.flat(t).nbytes) for t in pool.bytes_per_block
    ):
        if size == 0:
            continue
        if spans and spans[-1][0] + spans[-1][1] == start:
            spans[-1][1] += size
        else:
            spans.append([start, size])
    cudart = torch.cuda.cudart()
    done = []
    for start, size in spans:
        err = cudart.cudaHostRegister(start, size, 0)
        if int(err) != 0:
            logger.warning(
                "could not page-lock %d bytes of host slots at %#x: %s; their copies are "
                "staged by the CUDA driver",
                size,
                start,
                err,
            )
            continue
        done.append(start)
    return done


def page_unlock(addresses: list[int]) -> None:
    """Undoes `page_lock` (nothing to do for an empty list: torch is not asked)."""
    if not addresses:
        return
    import torch

    cudart = torch.cuda.cudart()
    for address in addresses:
        cudart.cudaHostUnregister(address)


def slot_runs(slots: npt.NDArray[np.integer]) -> list[tuple[int, int, int]]:
    """`(a, b, s0)`: staging rows `[a, b)` are slots `[s0, s0 + b - a)` (maximal runs of
    consecutive slots)."""
    if slots.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [slots.size]))
    return [(int(a), int(b), int(slots[a])) for a, b in zip(starts, ends, strict=True)]


def _widest(width: int, *views: torch.Tensor) -> torch.dtype:
    """The widest integer dtype whose items tile `width` and every view's rows (the
    gather and the copies then move 8-byte words instead of bytes)."""
    import torch

    for dtype in (torch.int64, torch.int32, torch.int16):
        k = dtype.itemsize
        if width % k == 0 and all(
            v.data_ptr() % k == 0 and v.stride(0) % k == 0 and v.storage_offset() % k == 0
            for v in views
        ):
            return dtype
    return torch.uint8


class SlotDMA:
    """Copies the moves of a job between the tensors (`geo`) and the pool's slots.

    Args:
      geo: the registered tensors' block geometry, by tensor index.
      pool: the slots (its `flat(t)` rows; the memory the copy engine writes).
      pinned: staging in host memory (narrow moves) is pinned (CUDA only).
      max_staging_bytes: largest device staging per gather or scatter.
    """

    def __init__(
        self,
        geo: Sequence[TensorBytes],
        pool: HostChunkPool,
        *,
        pinned: bool,
        max_staging_bytes: int,
    ) -> None:
        import torch

        self._torch = torch
        self._geo = geo
        self._pool = pool
        self._pinned = pinned
        self._max_staging = max_staging_bytes
        self._slots = {t: torch.from_numpy(pool.flat(t)) for t in pool.bytes_per_block}

    def _pieces(self, m: TensorMove) -> list[tuple[int, int]]:
        per = max(1, self._max_staging // max(1, m.width))
        n = len(m.block_ids)
        return [(a, min(n, a + per)) for a in range(0, n, per)]

    def _ids(self, m: TensorMove, a: int, b: int, device: torch.device) -> torch.Tensor:
        ids = self._torch.as_tensor(np.asarray(m.block_ids[a:b], dtype=np.int64))
        if device.type == "cpu":
            return ids
        # From pinned memory: an asynchronous copy (pageable would wait for the stream).
        return (ids.pin_memory() if self._pinned else ids).to(device, non_blocking=True)

    def _host(self, n: int, width: int) -> torch.Tensor:
        return self._torch.empty((n, width), dtype=self._torch.uint8, pin_memory=self._pinned)

    def store(
        self,
        moves: Sequence[TensorMove],
        streams: Mapping[torch.device, CopyStream],
        ready: Mapping[torch.device, CopyEvent | None],
    ) -> None:
        """Issues a store's gathers and D2H copies, waits for them (worker thread)."""
        narrow = []  # (move, first slot, host staging): written by the CPU once landed
        done = []
        for m in moves:
            geo, full = self._geo[m.tensor], m.width == self._pool.bytes_per_block[m.tensor]
            stream = streams[geo.device]
            slots = self._pool.slots(list(m.chunk_ids), m.first_slot, len(m.block_ids))
            src = geo.block_view(m.width)
            dst = self._slots[m.tensor]
            dtype = _widest(m.width, src, dst) if full else self._torch.uint8
            with stream.issue():
                stream.wait(ready[geo.device])
                for a, b in self._pieces(m):
                    staging = src.view(dtype).index_select(0, self._ids(m, a, b, geo.device))
                    if not full:
                        host = self._host(b - a, m.width)
                        host.copy_(staging, non_blocking=True)
                        narrow.append((m, m.first_slot + a, host))
                        continue
                    wide = dst.view(dtype)
                    for ra, rb, s0 in slot_runs(slots[a:b]):
                        wide[s0 : s0 + rb - ra].copy_(staging[ra:rb], non_blocking=True)
                done.append(stream.record())
        for event in done:
            event.synchronize()
        for m, first, host in narrow:
            self._pool.write_blocks(m.tensor, list(m.chunk_ids), first, host.numpy())

    def load(
        self,
        moves: Sequence[TensorMove],
        streams: Mapping[torch.device, CopyStream],
        ready: Mapping[torch.device, CopyEvent | None],
    ) -> None:
        """Issues a load's H2D copies and scatters, waits for them (worker thread).
        Every slot is read before any device byte is written: a failed read or copy
        leaves the tensors as they were."""
        staged = []  # (destination view, device ids, device staging, stream, host staging)
        for m in moves:
            geo, full = self._geo[m.tensor], m.width == self._pool.bytes_per_block[m.tensor]
            stream = streams[geo.device]
            slots = self._pool.slots(list(m.chunk_ids), m.first_slot, len(m.block_ids))
            dst = geo.block_view(m.width)
            src = self._slots[m.tensor]
            dtype = _widest(m.width, dst, src) if full else self._torch.uint8
            with stream.issue():
                stream.wait(ready[geo.device])
                for a, b in self._pieces(m):
                    ids = self._ids(m, a, b, geo.device)
                    host = None
                    if full:
                        k = dtype.itemsize
                        staging = self._torch.empty(
                            (b - a, m.width // k), dtype=dtype, device=geo.device
                        )
                        wide = src.view(dtype)
                        for ra, rb, s0 in slot_runs(slots[a:b]):
                            staging[ra:rb].copy_(wide[s0 : s0 + rb - ra], non_blocking=True)
                    else:
                        host = self._host(b - a, m.width)
                        self._pool.read_blocks(
                            m.tensor, list(m.chunk_ids), m.first_slot + a, b - a, host.numpy()
                        )
                        staging = host.to(geo.device, non_blocking=True)
                    staged.append((dst.view(dtype), ids, staging, stream, host))
        done = []
        for dst, ids, staging, stream, _host in staged:
            with stream.issue():
                dst.index_copy_(0, ids, staging)
        for stream in {id(s): s for _, _, _, s, _ in staged}.values():
            done.append(stream.record())
        for event in done:
            event.synchronize()
