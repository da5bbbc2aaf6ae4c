"""Worker side for torch engines: vLLM's KV tensors <-> our host chunks.

Stores go through our `TransferEngine`: every registered tensor is viewed zero-copy as
whole-allocation pages (`raw_pages`, DLPack) and is one engine group, so the gather
kernel reads vLLM's memory directly and host rows hold `blocks_per_chunk` pages per
tensor, like vLLM's direct CPU layout. Loads cannot use the engine's donated scatter
(measured: a donated XLA scatter on a DLPack-imported buffer writes a new buffer, never
the torch one), so a load reads the chunk rows and writes them with one torch
`index_copy_` per tensor into vLLM's own tensor (docs/vllm.md, "Load path").

Threads: `submit_*`, `get_finished`, `wait` and `shutdown` are called from one thread
(vLLM's worker). Stores run on the engine's store thread; loads on one thread per queue
(regular, expedited), FIFO each.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

import pallas_kernels as pk
from jax_kvoffload.bridge._job_plan import JobSpecError, TensorMove, plan_job
from jax_kvoffload.bridge._torch import raw_pages, to_jax
from jax_kvoffload.transfer import GroupCaches, GroupTransfer, HostChunkPool, TransferEngine

__all__ = ["Finished", "TorchKVWorker"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Finished:
    """One ended job, in vLLM's `TransferResult` terms (size in bytes, time in s)."""

    job_id: int
    success: bool
    transfer_size: int
    transfer_time: float


@dataclass
class _Load:
    job_id: int
    future: Future
    size: int
    started: float


def _sync_device(tensor: Any) -> None:
    """Orders our reads after the engine's pending writes to an accelerator tensor.

    On CPU torch ops are synchronous. On an accelerator our JAX work runs on JAX's own
    stream, which does not wait for torch's compute stream (untested on hardware)."""
    if tensor.device.type != "cpu":
        import torch

        torch.accelerator.synchronize(tensor.device)


class TorchKVWorker:
    """Moves blocks between torch KV tensors and a host chunk pool.

    Args:
      tensors: `[(tensor, page_size_bytes)]`, each a `[num_blocks, page]` int8/uint8
        view (vLLM's `CanonicalKVCacheTensor`s) or any tensor whose block axis is 0.
      group_refs: per group, the `(tensor_idx, unpadded_page_bytes)` of its layers, in
        layer order (vLLM's `CanonicalKVCacheRef`s).
      blocks_per_chunk: device blocks per host chunk.
      num_chunks: host chunks (the manager's `num_chunks`).
      result_type: builds a result from `Finished`'s fields (vLLM's `TransferResult`).
      backend, max_bucket: passed to the transfer engine / kernels.
      pool: host pool to use instead of a private `HostChunkPool` (e.g. a
        `CanonicalPoolView`); its `bytes_per_block[t]` must be tensor t's page bytes.
      on_shutdown: called once after `shutdown` has drained every job (e.g. to unmap a
        shared host region).
      not_ready: returns why jobs cannot run yet (e.g. not every rank has mapped the
        shared region), or None; while it gives a reason, jobs end as failures.
    """

    def __init__(
        self,
        tensors: Sequence[tuple[Any, int]],
        group_refs: Sequence[Sequence[tuple[int, int]]],
        *,
        blocks_per_chunk: int,
        num_chunks: int,
        result_type: Any = Finished,
        backend: str = "auto",
        max_bucket: int = 256,
        pool: Any = None,
        on_shutdown: Any = None,
        not_ready: Any = None,
    ) -> None:
        self._pages = [raw_pages(t) for t, _ in tensors]
        for i, ((t, page), rp) in enumerate(zip(tensors, self._pages, strict=True)):
            if rp.block_rows.shape[1] != 1 or rp.page_bytes != page:
                raise JobSpecError(
                    f"tensor {i} (shape {tuple(t.shape)}) must be one {page}-byte page per "
                    f"block; its pages are {rp.page_bytes} bytes x {rp.block_rows.shape[1]}"
                )
        self._tensors = [t for t, _ in tensors]
        self._group_refs = [list(refs) for refs in group_refs]
        for g, refs in enumerate(self._group_refs):
            for idx, unpadded in refs:
                if not 0 <= idx < len(tensors) or not 0 < unpadded <= tensors[idx][1]:
                    raise JobSpecError(f"group {g}: bad ref (tensor {idx}, page {unpadded})")
        self._bpc = blocks_per_chunk
        self._result_type = result_type
        widths = {i: rp.page_bytes for i, rp in enumerate(self._pages)}
        if pool is None:
            pool = HostChunkPool(num_chunks, widths, blocks_per_chunk)
        elif dict(pool.bytes_per_block) != widths or pool.blocks_per_chunk != blocks_per_chunk:
            raise JobSpecError(
                f"the pool holds {dict(pool.bytes_per_block)} bytes per block in chunks of "
                f"{pool.blocks_per_chunk}; the tensors need {widths} in chunks of "
                f"{blocks_per_chunk}"
            )
        self.pool = pool
        self._on_shutdown = on_shutdown
        self._not_ready = not_ready
        caches = {
            i: GroupCaches([to_jax(rp.rows)], pk.KVLayout.raw()) for i, rp in enumerate(self._pages)
        }
        self._engine = TransferEngine(caches, self.pool, backend=backend, max_bucket=max_bucket)
        self._store_sizes: dict[int, int] = {}
        self._loads = {q: deque() for q in ("load", "expedited")}
        self._threads = {
            q: ThreadPoolExecutor(1, thread_name_prefix=f"kv-{q}") for q in self._loads
        }
        self._ready: list[Any] = []
        self._closed = False

    # -- vLLM OffloadingWorker API -------------------------------------------------

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """Device blocks (`src_spec`: ids, group_sizes, block_indices) -> host chunks."""
        moves, size = self._plan(src_spec, dst_spec, src_is_device=True)
        if self._refused(job_id, size):
            return True
        for t in {m.tensor for m in moves}:
            _sync_device(self._tensors[t])
        transfers = [
            GroupTransfer(m.tensor, tuple(self._rows(m)), m.chunk_ids, m.first_slot) for m in moves
        ]
        self._engine.submit_store(job_id, transfers)
        if hasattr(self.pool, "store_bytes"):  # canonical pages: only the bytes written
            size = sum(
                self.pool.store_bytes(m.tensor, list(m.chunk_ids), m.first_slot, len(m.block_ids))
                for m in moves
            )
        self._store_sizes[job_id] = size
        return True

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        """Host chunks (`src_spec`) -> device blocks (`dst_spec`); returns at once."""
        moves, size = self._plan(dst_spec, src_spec, src_is_device=False)
        if self._refused(job_id, size):
            return True
        queue = "expedited" if expedited else "load"
        future = self._threads[queue].submit(self._run_load, moves)
        self._loads[queue].append(_Load(job_id, future, size, time.perf_counter()))
        return True

    def get_finished(self) -> list[Any]:
        """Results of the jobs that ended since the last call (FIFO per queue)."""
        out, self._ready = self._ready, []
        out += [self._store_result(r) for r in self._engine.get_finished()]
        for queue in self._loads.values():
            while queue and queue[0].future.done():
                out.append(self._load_result(queue.popleft()))
        return out

    def wait(self, job_ids: set[int] | Sequence[int]) -> None:
        """Blocks until the given jobs ended; their results stay for `get_finished`."""
        wanted = set(job_ids)
        stores = [j for j in wanted if j in self._store_sizes]
        if stores:
            self._ready += [self._store_result(r) for r in self._engine.wait(stores)]
        for queue in self._loads.values():
            for load in queue:
                if load.job_id in wanted:
                    load.future.exception()  # waits without raising

    def shutdown(self) -> None:
        """Waits for every job, then frees the threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.wait(set(self._store_sizes) | {ld.job_id for q in self._loads.values() for ld in q})
        self._engine.close()
        for pool in self._threads.values():
            pool.shutdown(wait=True)
        if self._on_shutdown is not None:
            self._on_shutdown()

    # -- internals ------------------------------------------------------------------

    def _plan(self, device_spec: Any, host_spec: Any, *, src_is_device: bool):
        if self._closed:
            raise JobSpecError("the worker is shut down")
        return plan_job(
            device_spec.block_ids,
            getattr(device_spec, "group_sizes", None),
            getattr(device_spec, "block_indices", None),
            host_spec.block_ids,
            self._group_refs,
            self._bpc,
        )

    def _refused(self, job_id: int, size: int) -> bool:
        """Ends the job as a failure while `not_ready` gives a reason (logged)."""
        if self._not_ready is None:
            return False
        reason = self._not_ready()
        if reason is None:
            self._not_ready = None  # ready for good
            return False
        logger.error("job %d refused: %s", job_id, reason)
        self._ready.append(self._result_type(job_id, False, size, 0.0))
        return True

    def _rows(self, move: TensorMove) -> np.ndarray:
        return self._pages[move.tensor].rows_of(move.block_ids)

    def _run_load(self, moves: list[TensorMove]) -> None:
        import torch

        for m in moves:
            rp = self._pages[m.tensor]
            host = np.empty((len(m.block_ids), rp.page_bytes), dtype=np.uint8)
            self.pool.read_blocks(m.tensor, list(m.chunk_ids), m.first_slot, len(host), host)
            dst = rp.rows
            index = torch.from_numpy(self._rows(m))
            src = torch.from_numpy(host)
            if dst.device.type != "cpu":  # one H2D copy of the staged pages
                src, index = src.to(dst.device), index.to(dst.device)
            dst.index_copy_(0, index, src)
            _sync_device(dst)

    def _store_result(self, r: Any) -> Any:
        size = self._store_sizes.pop(r.job_id, r.size_bytes)
        if not r.success:
            logger.warning("store job %d failed: %s", r.job_id, r.error)
        return self._result_type(r.job_id, r.success, size, r.seconds)

    def _load_result(self, load: _Load) -> Any:
        error = load.future.exception()
        if error is not None:
            logger.warning("load job %d failed: %r", load.job_id, error)
        seconds = time.perf_counter() - load.started
        return self._result_type(load.job_id, error is None, load.size, seconds)
