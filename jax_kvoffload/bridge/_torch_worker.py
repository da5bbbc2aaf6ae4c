"""Worker side for torch engines: vLLM's KV tensors <-> our host chunks.

The bytes moved are exactly vLLM 0.33.0's `CPUOffloadingWorker`'s: per block and ref,
the ref's *unpadded* page from the start of the block's row, wherever that row lies in
the tensor's storage (`_tensor_bytes`); every other device byte stays as it is, and a
host slot holds only the widest unpadded page of its tensor. `transfer_size` is vLLM's
count (every ref's unpadded page; a canonical store: the bytes this rank wrote).

Accelerator tensors take the copy-engine path (`_torch_dma`, `dma=True` forces it on
CPU): the host slots are one allocation, page-locked once when CUDA is there
(`cudaHostRegister`), a store gathers its blocks on the device and copies them D2H
straight into their slots, one copy per contiguous run of slots, a load copies the runs
H2D and scatters them with `index_copy_` into vLLM's own tensor; all on the lane's own
stream, after an event of the caller's stream, and the job ends when its event
completes (`_torch_streams`; on CPU a synchronous stand-in). No KV byte is copied by the
CPU (`pool.host_copies`; tests/bridge/test_torch_host_copies.py).

The other paths copy each byte once with the CPU (counted): a CPU tensor's store copies
the blocks from a numpy view into the slots (`dma=False`, the default on CPU: no device
staging to fill), its load reads the slots into a staging array for `index_copy_`;
`store_kernel=True` gathers with our kernel over a zero-copy JAX view of the tensor's
storage (a DLPack import of its block span as `[rows, unit]` bytes), `jax.device_put`s
the staging to host memory and writes the slots on the store thread (tests,
benchmarks). Loads cannot use a donated JAX scatter (measured: a donated XLA scatter on
a DLPack-imported buffer writes a new buffer, never the torch one). docs/vllm.md,
"Data path".

Threads: `submit_*`, `get_finished`, `wait` and `shutdown` are called from one thread
(vLLM's worker). Stores, regular loads and expedited loads each run on their own thread
and complete FIFO, like vLLM's three handlers. The jobs themselves (ids, lanes, order,
timing, tally, the report-once bookkeeping) are the transfer engine's job core
(`transfer/_job_core.py`); this module is the data path and vLLM's call shapes.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import numpy.typing as npt

import pallas_kernels as pk
from jax_kvoffload.bridge._job_plan import JobSpecError, TensorMove, int_ids, plan_job
from jax_kvoffload.bridge._tensor_bytes import UnitRows
from jax_kvoffload.bridge._torch_dma import SlotDMA, page_lock, page_unlock
from jax_kvoffload.bridge._torch_layout import check_int as _check_int
from jax_kvoffload.bridge._torch_layout import check_layout, host_widths
from jax_kvoffload.bridge._torch_streams import copy_stream, submit_event
from jax_kvoffload.config.internals import checked_arguments
from jax_kvoffload.errors import KVOffloadStateError, KVOffloadTypeError
from jax_kvoffload.hostmem import HostChunkPool, HostPool, build_host_pool
from jax_kvoffload.stats import TransferTally, TransferTotals
from jax_kvoffload.transfer import Direction, bucket_sizes
from jax_kvoffload.transfer.internals import EngineJob, JobCore, JobError, bucket_for, to_host

if TYPE_CHECKING:
    from typing import TypeAlias

    import jax
    import torch

    # A store's blocks on their way to the slots: `(move, first slot, blocks, host
    # staging)`, the staging a D2H copy under way or a numpy gather still to run.
    _Staged: TypeAlias = tuple[
        TensorMove, int, int, jax.Array | Callable[[], npt.NDArray[np.uint8]]
    ]

__all__ = ["Finished", "TorchKVWorker", "WorkerClosedError", "host_widths"]

logger = logging.getLogger(__name__)

# vLLM's three handlers: one lane (worker thread, FIFO completion) each.
_LANES = {"store": Direction.STORE, "load": Direction.LOAD, "expedited": Direction.LOAD}


class BlockSpec(Protocol):
    """A job's side as vLLM describes it (`GPULoadStoreSpec`, `CPULoadStoreSpec`): the
    block (or chunk) ids; a device side may add `group_sizes` and `block_indices`,
    read with `getattr`."""

    @property
    def block_ids(self) -> npt.ArrayLike: ...


class WorkerClosedError(KVOffloadStateError):
    """A job was submitted after `shutdown`."""


@dataclass(frozen=True)
class Finished:
    """One ended job, in vLLM's `TransferResult` terms (size in bytes, time in s)."""

    job_id: int
    success: bool
    transfer_size: int
    transfer_time: float


def _sync_device(device: torch.device) -> None:
    """Orders our reads after the engine's pending writes to an accelerator tensor.

    On CPU torch ops are synchronous. On an accelerator our JAX work runs on JAX's own
    stream, which does not wait for torch's compute stream (untested on hardware)."""
    if device.type != "cpu":
        import torch

        torch.accelerator.synchronize(device)


def _slot_memory(num_chunks: int, widths: dict[int, int], bpc: int) -> npt.NDArray[np.uint8]:
    """The host slots of the copy-engine path on CUDA: one anonymous mapping of exactly
    the pool's bytes (zeroed, page-aligned), page-locked once by `page_lock`. Not
    `torch.empty(..., pin_memory=True)`: torch's caching host allocator rounds a pinned
    block up to the next power of two (pytorch/pytorch#150517: a 65 GiB pool would pin
    128 GiB)."""
    nbytes = HostChunkPool.nbytes_for(num_chunks, widths, bpc)
    return np.frombuffer(mmap.mmap(-1, max(1, nbytes)), dtype=np.uint8)[:nbytes]


@checked_arguments
class TorchKVWorker:
    """Moves blocks between torch KV tensors and a host chunk pool.

    Args:
      tensors: `[(tensor, page_size_bytes)]` (vLLM's `CanonicalKVCacheTensor`s): block b
        is the row b of `tensor.view(uint8).view(-1, page_size_bytes)`, at any byte
        offset and stride of the tensor's storage.
      group_refs: per group, the `(tensor_idx, unpadded_page_bytes)` of its layers, in
        layer order (vLLM's `CanonicalKVCacheRef`s); `0 <= unpadded <= page`.
      blocks_per_chunk: device blocks per host chunk.
      num_chunks: host chunks (the manager's `num_chunks`).
      result_type: builds a result from `Finished`'s fields (vLLM's `TransferResult`).
      backend, max_bucket: passed to the gather kernel / its bucketing.
      max_staging_bytes: largest staging array per kernel call.
      store_kernel: gather stores with our kernel (True; the host slots are then
        written by the CPU), or copy CPU tensors' blocks with numpy (False); None: the
        copy-engine path (`dma`) for accelerator tensors, numpy for CPU tensors.
      dma: the copy-engine path in both directions (D2H straight into the pool's
        slots and H2D straight from them, on the worker's own streams): None (default)
        for accelerator tensors unless `store_kernel=True`; True forces it on CPU too
        (tests count its host copies there). Needs a `HostChunkPool` (the private
        pool or a shared region's; page-locked once when CUDA is available).
      pool: host pool to use instead of a private `HostChunkPool` (a shared region's, or
        a `CanonicalPoolView`); its `bytes_per_block[t]` must be `widths[t]`.
      on_shutdown: called once after `shutdown` has drained every job (e.g. to unmap a
        shared host region).
      not_ready: returns why jobs cannot run yet (e.g. not every rank has mapped the
        shared region), or None; while it gives a reason, jobs end as failures.

    Attributes:
      widths: tensor index -> bytes a host slot holds per block: the widest unpadded page
        of the refs on the tensor (tensors no ref points at have none).
    """

    def __init__(
        self,
        tensors: Sequence[tuple[torch.Tensor, int]],
        group_refs: Sequence[Sequence[tuple[int, int]]],
        *,
        blocks_per_chunk: int,
        num_chunks: int,
        result_type: Callable[[int, bool, int, float], Any] = Finished,
        backend: str = "auto",
        max_bucket: int = 256,
        max_staging_bytes: int = 64 << 20,
        store_kernel: bool | None = None,
        dma: bool | None = None,
        pool: HostPool | None = None,
        on_shutdown: Callable[[], object] | None = None,
        not_ready: Callable[[], str | None] | None = None,
    ) -> None:
        self._bpc = _check_int("blocks_per_chunk", blocks_per_chunk, 1)
        num_chunks = _check_int("num_chunks", num_chunks, 0)
        bucket_sizes(0, max_bucket)  # validates max_bucket
        max_staging_bytes = _check_int("max_staging_bytes", max_staging_bytes, 0)
        layout = check_layout(tensors, group_refs)
        self._geo, self._group_refs, self.widths = layout.geo, layout.group_refs, layout.widths
        ref_widths = layout.ref_widths
        self._result_type = result_type
        devices = {self._geo[t].device for t in self.widths}
        if dma is None:
            dma = store_kernel is not True and any(d.type != "cpu" for d in devices)
            dma = dma and (pool is None or isinstance(pool, HostChunkPool))
        elif dma and store_kernel:
            raise JobSpecError("dma=True stores without our kernel; drop store_kernel=True")
        elif dma and pool is not None and not isinstance(pool, HostChunkPool):
            raise JobSpecError(
                f"dma=True copies straight into a HostChunkPool's slots; got a "
                f"{type(pool).__name__} (use dma=None)"
            )
        pinned = bool(dma) and any(d.type == "cuda" for d in devices)
        self._locked: list[int] = []  # addresses of a given pool we page-locked
        buffer = None
        if pool is None:
            buffer = _slot_memory(num_chunks, self.widths, self._bpc) if pinned else None
            pool, _ = build_host_pool(num_chunks, self.widths, self._bpc, buffer=buffer)
        elif not isinstance(pool, HostPool):
            raise KVOffloadTypeError(
                f"pool must be a HostPool (HostChunkPool, CanonicalPoolView, ...), got "
                f"{type(pool).__name__}"
            )
        elif (dict(pool.bytes_per_block), pool.blocks_per_chunk, pool.num_chunks) != (
            self.widths,
            self._bpc,
            num_chunks,
        ):
            raise JobSpecError(
                f"the pool holds {dict(pool.bytes_per_block)} bytes per block in "
                f"{pool.num_chunks} chunks of {pool.blocks_per_chunk}; the tensors need "
                f"{self.widths} in {num_chunks} chunks of {self._bpc}"
            )
        self.pool = pool
        self._dma = None
        if dma:
            if not isinstance(pool, HostChunkPool):  # a caller's pool of another kind
                raise JobSpecError(
                    f"dma=True needs the worker's own slots (a HostChunkPool), got a "
                    f"{type(pool).__name__}: drop dma=True or pass no pool"
                )
            if pinned:  # page-locked once: the copy engine reads and writes it directly
                self._locked = page_lock(pool)
            self._dma = SlotDMA(self._geo, pool, pinned=pinned, max_staging_bytes=max_staging_bytes)
        # One copy stream per lane and device (vLLM: one per handler).
        self._streams = {lane: {d: copy_stream(d) for d in devices} for lane in _LANES}
        if store_kernel is False and any(self._geo[t].device.type != "cpu" for t in self.widths):
            raise JobSpecError("store_kernel=False needs CPU tensors; use None or True")
        self._units: dict[int, UnitRows] = {
            t: self._geo[t].unit_rows(ref_widths[t], f"tensor {t}")
            for t in self.widths
            if store_kernel
            or (store_kernel is None and not dma and self._geo[t].device.type != "cpu")
        }
        self._kernel_kw = {"backend": backend}
        self._buckets = (max_bucket, max_staging_bytes)
        self._on_shutdown = on_shutdown
        self._not_ready = not_ready
        # Results are the caller's `result_type` (vLLM's TransferResult in the plug-in),
        # hence Any: vLLM's abstract worker types `get_finished` as list[TransferResult].
        self._ready: list[Any] = []  # refused jobs' results (never queued)
        self._shut_down = False  # every job ended, on_shutdown called
        self._tally = TransferTally()
        self._core: JobCore[Any] = JobCore(_LANES, self._result, fifo=True, tally=self._tally)

    # -- vLLM OffloadingWorker API -------------------------------------------------

    # The specs are vLLM's (`GPULoadStoreSpec`, `CPULoadStoreSpec`), read as `BlockSpec`s;
    # Any because vLLM's abstract worker types a side as `LoadStoreSpec`, which has no
    # `block_ids`, and `JaxOffloadingWorker` must stay compatible with it.

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """Device blocks (`src_spec`: ids, group_sizes, block_indices) -> host chunks."""
        moves, size = self._plan(job_id, src_spec, dst_spec, load=False)
        written = [
            self.pool.store_bytes(m.tensor, list(m.chunk_ids), m.first_slot, len(m.block_ids))
            for m in moves
        ]
        if moves and None not in written:  # vLLM counts what this rank writes (canonical)
            size = sum(m.refs * w for m, w in zip(moves, cast("list[int]", written), strict=True))
        if self._refused(job_id, size, store=True):
            return True
        if self._dma is not None:
            self._submit_copies(job_id, "store", moves, size)
            return True
        for device in {self._geo[m.tensor].device for m in moves}:
            _sync_device(device)
        started = time.perf_counter()  # a store's time includes its gather
        try:
            staged = [piece for m in moves for piece in self._gather(m)]
        except Exception as exc:  # e.g. device memory exhausted: the job fails, reported
            self._core.fail(job_id, "store", exc, size, started=started)
            return True
        self._core.submit(job_id, "store", lambda: self._write(staged), size, started=started)
        return True

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        """Host chunks (`src_spec`) -> device blocks (`dst_spec`); returns at once."""
        moves, size = self._plan(job_id, dst_spec, src_spec, load=True)
        if self._refused(job_id, size, store=False):
            return True
        lane = "expedited" if expedited else "load"
        if self._dma is not None:
            self._submit_copies(job_id, lane, moves, size)
        else:
            self._core.submit(job_id, lane, lambda: self._run_load(moves), size)
        return True

    def get_finished(self) -> list[Any]:
        """Results of the jobs that ended since the last call (FIFO per queue)."""
        out, self._ready = self._ready, []
        return out + self._core.collect()

    def wait(self, job_ids: set[int] | Sequence[int]) -> None:
        """Blocks until the given jobs ended; their results stay for `get_finished`."""
        if isinstance(job_ids, (str, bytes)) or not isinstance(job_ids, Iterable):
            raise KVOffloadTypeError(
                f"job_ids must be a set or sequence of job ids, got {type(job_ids).__name__}"
            )
        self._core.join(set(int_ids("job_ids", list(job_ids))))

    def transfer_totals(self) -> tuple[TransferTotals, TransferTotals]:
        """(store, load) totals of the jobs reported so far (docs/observability.md);
        callable from any thread."""
        return self._tally.totals()

    def shutdown(self) -> None:
        """Waits for every job, then frees the threads. Idempotent; if interrupted while
        it waits, new jobs are already refused and the next call finishes the job."""
        if self._shut_down:
            return
        # Waits for the jobs' own futures (on_shutdown may unmap the memory a running
        # job still writes); their results stay for get_finished, as vLLM's.
        self._core.close(complete=False)
        if not self._shut_down:
            self._shut_down = True
            locked, self._locked = self._locked, []
            page_unlock(locked)  # before on_shutdown unmaps the memory
            if self._on_shutdown is not None:
                self._on_shutdown()

    # -- internals ------------------------------------------------------------------

    def _plan(
        self, job_id: int, device_spec: BlockSpec, host_spec: BlockSpec, *, load: bool
    ) -> tuple[list[TensorMove], int]:
        """The job's moves, checked: ids in range, a load writing each block once."""
        if self._core.closing:
            raise WorkerClosedError(f"job {job_id}: the worker is shut down")
        _check_int("job_id", job_id, 0)
        if self._core.in_flight(job_id):
            raise JobSpecError(f"job id {job_id} is already in flight")
        moves, size = plan_job(
            device_spec.block_ids,
            getattr(device_spec, "group_sizes", None),
            getattr(device_spec, "block_indices", None),
            host_spec.block_ids,
            self._group_refs,
            self._bpc,
        )
        written: dict[int, set[int]] = {}
        for m in moves:
            self.pool.check_chunks(list(m.chunk_ids))
            nb = self._geo[m.tensor].num_blocks
            if max(m.block_ids) >= nb:
                raise JobSpecError(
                    f"tensor {m.tensor}: block ids {sorted(b for b in m.block_ids if b >= nb)[:8]}"
                    f" are outside [0, {nb})"
                )
            if load:
                seen = written.setdefault(m.tensor, set())
                if len(seen | set(m.block_ids)) != len(seen) + len(m.block_ids):
                    raise JobSpecError(
                        f"a load writes tensor {m.tensor}'s blocks more than once "
                        f"({sorted(m.block_ids)[:8]}...): the bytes left would depend on "
                        "copy order; list each device block once per load"
                    )
                seen.update(m.block_ids)
        return moves, size

    def _submit_copies(self, job_id: int, lane: str, moves: list[TensorMove], size: int) -> None:
        """Queues a job of the copy-engine path on `lane`. Per device of the job an event
        is recorded on the caller's current stream now: the job's copies run after the
        engine's work issued so far, and nothing here waits for the device."""
        dma = self._dma
        assert dma is not None  # internal: only the copy-engine path submits here
        try:
            devices = {self._geo[m.tensor].device for m in moves}
            ready = {d: submit_event(d) for d in devices}
        except Exception as exc:  # e.g. a CUDA error: the job fails, reported
            self._core.fail(job_id, lane, exc, size)
            return
        streams = self._streams[lane]
        run = dma.store if _LANES[lane] is Direction.STORE else dma.load
        self._core.submit(job_id, lane, lambda: run(moves, streams, ready), size)

    def _refused(self, job_id: int, size: int, store: bool) -> bool:
        """Ends the job as a failure while `not_ready` gives a reason (logged)."""
        if self._not_ready is None:
            return False
        reason = self._not_ready()
        if reason is None:
            self._not_ready = None  # ready for good
            return False
        logger.error("job %d refused: %s", job_id, reason)
        self._ready.append(self._result_type(job_id, False, size, 0.0))
        self._tally.record(store, False, size, 0.0)
        return True

    def _gather(self, m: TensorMove) -> list[_Staged]:
        """The blocks of one move on their way to host memory, in power-of-two buckets:
        `[(move, first slot, blocks, host staging or a numpy gather to run)]`."""
        units = self._units.get(m.tensor)
        if units is None:  # a CPU tensor: numpy copies on the store thread
            view = self._geo[m.tensor].host_blocks(m.width)
            ids = np.asarray(m.block_ids, dtype=np.int64)
            return [(m, m.first_slot, len(ids), lambda: view[ids])]
        rows = units.rows_of(np.asarray(m.block_ids), m.width)
        k = m.width // units.unit
        on_cpu = next(iter(units.array.devices())).platform == "cpu"
        out: list[_Staged] = []
        start = 0
        for n in bucket_sizes(len(m.block_ids), bucket_for(m.width, *self._buckets)):
            ids = rows[start * k : (start + n) * k]
            staging = pk.gather_blocks(
                [units.array], ids, layout=pk.KVLayout.raw(), **self._kernel_kw
            )
            out.append((m, m.first_slot + start, n, to_host([staging], [on_cpu])[0]))
            start += n
        return out

    def _write(self, staged: list[_Staged]) -> None:
        for m, first, n, host in staged:
            data = host() if callable(host) else np.asarray(host)  # waits for the D2H copy
            self.pool.write_blocks(m.tensor, list(m.chunk_ids), first, data.reshape(n, m.width))

    def _run_load(self, moves: list[TensorMove]) -> None:
        import torch

        # Every slot is read before any device byte is written: a failed read leaves
        # the tensors as they were.
        reads = []
        for m in moves:
            host = np.empty((len(m.block_ids), m.width), dtype=np.uint8)
            self.pool.read_blocks(m.tensor, list(m.chunk_ids), m.first_slot, len(host), host)
            reads.append((m, host))
        for m, host in reads:
            dst = self._geo[m.tensor].block_view(m.width)
            index = torch.tensor(m.block_ids, dtype=torch.int64)
            src = torch.from_numpy(host)
            if dst.device.type != "cpu":  # one H2D copy of the staged pages
                src, index = src.to(dst.device), index.to(dst.device)
            dst.index_copy_(0, index, src)
            _sync_device(dst.device)

    def _result(self, job: EngineJob, error: JobError, seconds: float) -> Any:
        # The job core times the copy itself, as vLLM does (CUDA events), not the wait
        # until it is collected, and counts it in the tally.
        if error is not None:
            logger.warning("offload job %d failed: %r", job.job_id, error)
        return self._result_type(job.job_id, error is None, job.size_bytes, seconds)
