"""The worker-side transfer engine: device KV blocks <-> host chunk rows, asynchronously.

Store: gather kernel into a contiguous staging array (device) -> `jax.device_put` into
host memory (pinned where the platform has it) -> copied into the job's chunk rows.
Load: chunk rows -> staging (host) -> `jax.device_put` to the device -> scatter kernel,
in place. Block counts are split into power-of-two buckets, so each group compiles at
most log2(max_bucket) + 1 shapes per direction.

Threads: kernels are dispatched, and caches replaced, only on the caller's thread (in
`submit_*` and in `get_finished` / `wait`); one worker thread per direction waits for
transfers and touches host memory, so submits return at once. Completion order within
one direction is FIFO, like vLLM's handlers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

import pallas_kernels as pk
from jax_kvoffload.transfer._buckets import bucket_sizes
from jax_kvoffload.transfer._host_pool import HostChunkPool
from jax_kvoffload.transfer._jobs import Direction, GroupTransfer, TransferError, TransferResult
from jax_kvoffload.transfer._sharded_io import distinct_shards, fetch_sharded

logger = logging.getLogger(__name__)


@dataclass
class GroupCaches:
    """A group's device KV arrays (one per layer, or K and V) and their `KVLayout`."""

    arrays: list[jax.Array]
    layout: pk.KVLayout

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every array of the group (one staging entry)."""
        first = self.arrays[0]
        page = first.size // self.layout.num_blocks(tuple(first.shape)) * first.dtype.itemsize
        return page * len(self.arrays)

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks(tuple(self.arrays[0].shape))


def _host_sharding(staging: jax.Array) -> Any:
    """The staging array's own sharding in pinned host memory (when the platform has it).

    Derived from the staging array, not the caches: a cache's partition spec names the
    cache's axes, which are not the staging's `[n, arrays, *page]` axes.
    """
    kinds = {m.kind for m in next(iter(staging.devices())).addressable_memories()}
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            return staging.sharding.with_memory_kind(kind)
    return None


def _bucket_for(block_bytes: int, max_bucket: int, max_staging_bytes: int) -> int:
    """The largest power of two <= max_bucket whose staging fits max_staging_bytes."""
    bucket = max_bucket
    while bucket > 1 and bucket * block_bytes > max_staging_bytes:
        bucket //= 2
    return bucket


def _replicated(sharding: Any) -> Any:
    """A sharding that places a whole staging array on every device of `sharding`."""
    mesh = getattr(sharding, "mesh", None)
    if mesh is None:
        return sharding  # single device
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


class _HostBuffers:
    """Reused host staging buffers for loads, by shape, up to `limit` bytes kept free.

    Fresh multi-MiB allocations spend most of their time in page faults (measured on
    CPU: system time dominated the load path). A load holds one buffer per distinct shard
    of each bucket until its scatter has read them, so the bound is in bytes (enough for
    two jobs' staging), not in buffers per shape.
    """

    def __init__(self, limit: int) -> None:
        self._free: dict[tuple[int, int], list[np.ndarray]] = {}
        self._free_bytes = 0
        self._limit = limit
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, int]) -> np.ndarray:
        with self._lock:
            free = self._free.get(shape)
            if free:
                buffer = free.pop()
                self._free_bytes -= buffer.nbytes
                return buffer
        # 64-byte aligned: XLA:CPU then adopts the buffer in device_put instead of
        # copying it (an unaligned numpy buffer is copied: measured 1.5-2 GB/s).
        raw = np.empty(shape[0] * shape[1] + 64, dtype=np.uint8)
        offset = -raw.ctypes.data % 64
        return raw[offset : offset + shape[0] * shape[1]].reshape(shape)

    def give(self, buffer: np.ndarray) -> None:
        with self._lock:
            if self._free_bytes + buffer.nbytes <= self._limit:
                self._free.setdefault(buffer.shape, []).append(buffer)
                self._free_bytes += buffer.nbytes


@dataclass
class _Pending:
    job_id: int
    direction: Direction
    future: Future
    started: float
    size_bytes: int
    # loads: per piece (group, block ids, device staging, host buffer to give back)
    pieces: list[tuple[int, np.ndarray, Any, list[np.ndarray]]] | None = None


class TransferEngine:
    """Moves blocks between device caches and a `HostChunkPool`.

    Args:
      caches: group id -> `GroupCaches`. The engine owns the arrays from now on: read
        them back with `arrays(group)` after loads (scatters donate the old ones).
      pool: the host rows; `pool.bytes_per_block[g]` must equal the group's block bytes.
      backend, interpret, config: passed to the kernels (`pallas_kernels`).
      max_bucket: largest block count per kernel call (a power of two).
      max_staging_bytes: largest staging array per call; the bucket shrinks (by powers
        of two, down to one block) for groups with large blocks. Tens of MiB per
        `device_put` already run at full PCIe speed, while multi-GiB host allocations
        spend most of their time in page faults (measured on CPU: sys time dominated).
    """

    def __init__(
        self,
        caches: Mapping[int, GroupCaches],
        pool: HostChunkPool,
        *,
        backend: str = "auto",
        interpret: Any = False,
        config: Any = None,
        max_bucket: int = 256,
        max_staging_bytes: int = 64 << 20,
    ) -> None:
        bucket_sizes(0, max_bucket)  # validates max_bucket
        self._caches = dict(caches)
        for g, gc in self._caches.items():
            want = pool.bytes_per_block.get(g)
            if want != gc.block_bytes:
                raise TransferError(
                    f"group {g}: the host pool holds {want} bytes per block but the caches "
                    f"have {gc.block_bytes}; size the pool from the caches"
                )
        self._pool = pool
        self._kernel_kw = {"backend": backend, "interpret": interpret, "config": config}
        self._bucket = {
            g: _bucket_for(gc.block_bytes, max_bucket, max_staging_bytes)
            for g, gc in self._caches.items()
        }
        self._buffers = _HostBuffers(limit=2 * max_staging_bytes)
        self._on_cpu = {
            g: next(iter(gc.arrays[0].devices())).platform == "cpu"
            for g, gc in self._caches.items()
        }
        self._threads = {
            d: ThreadPoolExecutor(1, thread_name_prefix=f"kv-{d.value}") for d in Direction
        }
        self._pending: dict[int, _Pending] = {}
        self._done: dict[int, TransferResult] = {}
        self._lock = threading.Lock()
        self._closed = False

    # -- public API -----------------------------------------------------------------

    def arrays(self, group: int) -> list[jax.Array]:
        """The group's current device arrays (replaced by every completed load)."""
        return list(self._caches[group].arrays)

    def set_arrays(self, group: int, arrays: Sequence[jax.Array]) -> None:
        """Replaces the group's device arrays (e.g. after the engine's own prefill wrote
        K/V). Same count, shapes and dtypes as now; call on the caller's thread, after
        reading back `arrays(group)` following any completed load."""
        if group not in self._caches:
            raise TransferError(f"unknown group {group}; groups are {sorted(self._caches)}")
        if not isinstance(arrays, (list, tuple)):
            raise TypeError(f"arrays must be a list of jax.Array, got {type(arrays).__name__}")
        bad = sorted({type(a).__name__ for a in arrays if not isinstance(a, jax.Array)})
        if bad:
            raise TypeError(f"arrays must be a list of jax.Array, got elements of type {bad}")
        gc = self._caches[group]
        want = [(tuple(a.shape), a.dtype) for a in gc.arrays]
        got = [(tuple(a.shape), a.dtype) for a in arrays]
        if got != want:
            raise TransferError(
                f"group {group}: arrays must keep the shapes and dtypes of the current ones: "
                f"{len(want)} x {want[0][0]} {want[0][1]}, got {len(got)} arrays "
                f"{sorted({f'{shape} {dtype}' for shape, dtype in got})}"
            )
        gc.arrays = list(arrays)

    def submit_store(self, job_id: int, transfers: Sequence[GroupTransfer]) -> None:
        """Starts copying the blocks to their chunk rows; returns at once."""
        self._check(job_id, transfers)
        staged = []  # (group, transfer, first slot, host array)
        size = sum(len(t.block_ids) * self._caches[t.group].block_bytes for t in transfers)
        try:
            for t in transfers:
                gc = self._caches[t.group]
                start = 0
                for n in bucket_sizes(len(t.block_ids), self._bucket[t.group]):
                    ids = np.asarray(t.block_ids[start : start + n], dtype=np.int32)
                    staging = pk.gather_blocks(gc.arrays, ids, layout=gc.layout, **self._kernel_kw)
                    # On CPU the device array already is host memory: numpy reads it in
                    # place, and a device_put would only add a copy.
                    sharding = None if self._on_cpu[t.group] else _host_sharding(staging)
                    host = staging if sharding is None else jax.device_put(staging, sharding)
                    staged.append((t.group, t, t.first_slot + start, host))
                    start += n
        except Exception as exc:  # e.g. device memory exhausted: the job fails, reported
            self._enqueue_failed(job_id, Direction.STORE, exc, size)
            return

        def finish() -> None:
            for group, t, first, host in staged:
                shards = distinct_shards(host) if hasattr(self._pool, "move_shards") else None
                if shards is not None:
                    self._pool.move_shards(
                        group, list(t.chunk_ids), first, host.shape, host.dtype, shards, store=True
                    )
                    continue
                data = np.asarray(host)  # waits for the D2H copy
                rows = data.reshape(data.shape[0], -1).view(np.uint8)
                self._pool.write_blocks(group, list(t.chunk_ids), first, rows)

        self._enqueue(job_id, Direction.STORE, finish, size)

    def submit_load(self, job_id: int, transfers: Sequence[GroupTransfer]) -> None:
        """Starts copying chunk rows back into the blocks; caches change on completion."""
        self._check(job_id, transfers, unique=True)
        plan = []  # (group, ids, first slot, staging shape, dtype)
        size = 0
        for t in transfers:
            gc = self._caches[t.group]
            shape = (len(gc.arrays), *gc.layout.page_shape(tuple(gc.arrays[0].shape)))
            start = 0
            for n in bucket_sizes(len(t.block_ids), self._bucket[t.group]):
                ids = np.asarray(t.block_ids[start : start + n], dtype=np.int32)
                plan.append((t.group, ids, t, t.first_slot + start, (n, *shape)))
                start += n
            size += len(t.block_ids) * gc.block_bytes
        pieces: list[tuple[int, np.ndarray, Any, list[np.ndarray]]] = []

        def fetch() -> None:
            for group, ids, t, first, shape in plan:
                staged, buffers = self._fetch(group, t, first, shape)
                if not self._on_cpu[group]:
                    # A real H2D copy: the host buffers are free again.
                    for b in buffers:
                        self._buffers.give(b)
                    buffers = []
                pieces.append((group, ids, staged, buffers))

        self._enqueue(job_id, Direction.LOAD, fetch, size, pieces)

    def _fetch(
        self, group: int, t: GroupTransfer, first: int, shape: tuple[int, ...]
    ) -> tuple[jax.Array, list[np.ndarray]]:
        """The staging of one load piece on the caches' devices, and its host buffers."""
        gc = self._caches[group]
        dtype = gc.arrays[0].dtype
        # Sharded caches take their staging sharded like their page axes: each device
        # receives only its shard, read from the rows straight into its own buffer.
        sharding = pk.staging_sharding(gc.arrays, gc.layout)
        if sharding is not None and hasattr(self._pool, "move_shards"):
            chunk_ids = list(t.chunk_ids)

            def read(shards):
                self._pool.move_shards(group, chunk_ids, first, shape, dtype, shards, store=False)

            fetched = fetch_sharded(read, self._buffers.take, shape, dtype, sharding)
            if fetched is not None:
                return fetched
        rows = self._buffers.take((shape[0], gc.block_bytes))
        self._pool.read_blocks(group, list(t.chunk_ids), first, shape[0], rows)
        host = rows.view(dtype).reshape(shape)
        device = sharding or _replicated(gc.arrays[0].sharding)
        return jax.block_until_ready(jax.device_put(host, device)), [rows]

    def get_finished(self) -> list[TransferResult]:
        """Results of the jobs that ended since the last call; never blocks."""
        with self._lock:
            ready = [p for p in self._pending.values() if p.future.done()]
        for p in ready:
            self._complete(p)
        return [self._done.pop(p.job_id) for p in ready]

    def wait(self, job_ids: Iterable[int]) -> list[TransferResult]:
        """Blocks until the given jobs end; returns their results (in the given order)."""
        out = []
        for job_id in job_ids:
            with self._lock:
                pending = self._pending.get(job_id)
            if pending is not None:
                pending.future.exception()  # waits without raising
                self._complete(pending)
            if job_id not in self._done:
                raise TransferError(f"job {job_id} is unknown or was already collected")
            out.append(self._done.pop(job_id))
        return out

    def close(self) -> None:
        """Waits for running jobs, then stops the worker threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for pool in self._threads.values():
            pool.shutdown(wait=True)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------

    def _check(self, job_id: int, transfers: Sequence[GroupTransfer], unique: bool = False) -> None:
        if self._closed:
            raise TransferError("the transfer engine is closed")
        with self._lock:
            if job_id in self._pending or job_id in self._done:
                raise TransferError(f"job id {job_id} is already in use")
        bpc = self._pool.blocks_per_chunk
        for t in transfers:
            if t.group not in self._caches:
                raise TransferError(f"unknown group {t.group}; groups are {sorted(self._caches)}")
            slots = t.first_slot + len(t.block_ids)
            if t.first_slot < 0 or (t.first_slot >= bpc and t.block_ids):
                raise TransferError(f"first_slot={t.first_slot} must be in [0, {bpc})")
            if len(t.chunk_ids) * bpc < slots:
                raise TransferError(
                    f"group {t.group}: {len(t.block_ids)} blocks from slot {t.first_slot} need "
                    f"{-(-slots // bpc)} chunks, got {len(t.chunk_ids)}"
                )
            self._pool.check_chunks(list(t.chunk_ids))
            ids = np.asarray(t.block_ids, dtype=np.int64)
            nb = self._caches[t.group].num_blocks
            if ids.size and (ids.min() < 0 or ids.max() >= nb):
                raise TransferError(f"group {t.group}: block ids must be in [0, {nb})")
            if unique and len(set(t.block_ids)) != len(t.block_ids):
                raise TransferError(f"group {t.group}: a load's block ids must be unique")

    def _enqueue_failed(self, job_id, direction, error, size) -> None:
        future: Future = Future()
        future.set_exception(error)
        with self._lock:
            self._pending[job_id] = _Pending(job_id, direction, future, time.perf_counter(), size)

    def _enqueue(self, job_id, direction, fn, size, pieces=None) -> None:
        future = self._threads[direction].submit(fn)
        with self._lock:
            self._pending[job_id] = _Pending(
                job_id, direction, future, time.perf_counter(), size, pieces
            )

    def _complete(self, p: _Pending) -> TransferResult:
        with self._lock:
            if self._pending.pop(p.job_id, None) is None:
                return self._done[p.job_id]
        error = p.future.exception()
        if error is None and p.direction is Direction.LOAD:
            try:
                for group, ids, staging, buffers in p.pieces:
                    gc = self._caches[group]
                    gc.arrays = pk.scatter_blocks(
                        gc.arrays, ids, staging, layout=gc.layout, **self._kernel_kw
                    )
                    if buffers:
                        # On CPU the staging aliased the buffers (zero-copy device_put):
                        # reuse them only once the scatter has read them.
                        jax.block_until_ready(gc.arrays)
                        for b in buffers:
                            self._buffers.give(b)
            except Exception as exc:  # reported as a failed job, never dropped
                error = exc
        if error is not None:
            logger.warning("transfer job %d (%s) failed: %r", p.job_id, p.direction.value, error)
        result = TransferResult(
            job_id=p.job_id,
            direction=p.direction,
            success=error is None,
            size_bytes=p.size_bytes,
            seconds=time.perf_counter() - p.started,
            error=None if error is None else f"{type(error).__name__}: {error}",
        )
        self._done[p.job_id] = result
        return result
