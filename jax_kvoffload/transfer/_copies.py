"""The transfer engine's data path: device caches <-> staging <-> host chunk rows.

`TransferEngine` (_engine.py, over the job core) keeps the jobs; this holds
what moves a job's bytes: the store's gathers and row writes, the load's row reads,
H2D copies and scatters, and the reused host buffers of load staging. Which thread runs
each step is the engine's contract (its module docstring): gathers and scatters run on
the caller's thread, row writes and reads on the direction's worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

import pallas_kernels as pk
from jax_kvoffload.hostmem import HostPool
from jax_kvoffload.transfer._buckets import store_pieces
from jax_kvoffload.transfer._caches import GroupCaches
from jax_kvoffload.transfer._interrupts import deferred_interrupts
from jax_kvoffload.transfer._job_checks import CheckedTransfer
from jax_kvoffload.transfer._rpa_pages import canonical_sharding, merge_into_pages, to_canonical
from jax_kvoffload.transfer._sharded_io import distinct_shards, fetch_sharded
from jax_kvoffload.transfer._staging import HostBuffers, bucket_for, replicated, to_host

# One load piece to fetch: (group, block ids, transfer, first slot, staging shape).
LoadPlan = list[tuple[int, np.ndarray, CheckedTransfer, int, tuple[int, ...]]]
# One fetched load piece: (group, block ids, device staging, host buffers to give back).
LoadPieces = list[tuple[int, np.ndarray, Any, list[np.ndarray]]]
# One gathered store piece: (group, transfer, first slot, host array).
StorePieces = list[tuple[int, CheckedTransfer, int, Any]]


class FetchedLoad:
    """A load's pieces on the devices: filled by the worker thread (`fetch`), scattered
    in order on the caller's thread (`scatter`). `applied` survives an interrupt between
    two pieces, so the next completion resumes where it stopped."""

    __slots__ = ("applied", "pieces")

    def __init__(self) -> None:
        self.pieces: LoadPieces = []
        self.applied = 0


class StagedCopies:
    """Copies blocks between a `TransferEngine`'s caches and its pool, via staging.

    Shares the engine's `caches` mapping and `pool`: a group's arrays replaced by the
    engine (`set_arrays`) are the ones the next gather reads.
    """

    def __init__(
        self,
        caches: Mapping[int, GroupCaches],
        pool: HostPool,
        kernel_kw: dict[str, Any],
        max_bucket: int,
        max_staging_bytes: int,
    ) -> None:
        self._caches = caches
        self._pool = pool
        self._kernel_kw = kernel_kw
        self._bucket = {
            g: bucket_for(gc.block_bytes, max_bucket, max_staging_bytes) for g, gc in caches.items()
        }
        self._buffers = HostBuffers(limit=2 * max_staging_bytes)
        self._on_cpu = {
            g: next(iter(gc.arrays[0].devices())).platform == "cpu" for g, gc in caches.items()
        }

    # -- stores -----------------------------------------------------------------------

    def gather(self, transfers: list[CheckedTransfer]) -> StorePieces:
        """Dispatches the gathers (and D2H copies) of a store, on the caller's thread."""
        staged = []  # (group, transfer, first slot, host array)
        for t in transfers:
            gc = self._caches[t.group]
            for start, n in self._store_pieces(t):
                ids = t.block_ids[start : start + n].astype(np.int32)
                staging = pk.gather_blocks(gc.arrays, ids, layout=gc.layout, **self._kernel_kw)
                if gc.relays:  # canonical RPA pages: per-shard padding dropped on device
                    staging = to_canonical(gc.arrays, gc.canonical_kv_heads, staging)
                host = to_host(staging, self._on_cpu[t.group])
                staged.append((t.group, t, t.first_slot + start, host))
        return staged

    def _store_pieces(self, t: CheckedTransfer) -> list[tuple[int, int]]:
        per_chunk = self._pool.blocks_per_chunk if self._pool.adopts_rows else None
        return store_pieces(len(t.block_ids), self._bucket[t.group], t.first_slot, per_chunk)

    def write(self, staged: StorePieces) -> None:
        """Copies a store's gathered pieces into their chunk rows (worker thread)."""
        for group, t, first, host in staged:
            shards = distinct_shards(host) if self._pool.moves_shards else None
            if shards is not None:
                self._pool.move_shards(
                    group, t.chunk_ids, first, host.shape, host.dtype, shards, store=True
                )
                continue
            data = np.asarray(host)  # waits for the D2H copy
            rows = data.reshape(data.shape[0], -1).view(np.uint8)
            self._pool.write_blocks(group, t.chunk_ids, first, rows)

    # -- loads ------------------------------------------------------------------------

    def load_plan(self, checked: list[CheckedTransfer]) -> LoadPlan:
        """A load's pieces, one per kernel call, in the order they are scattered."""
        plan = []  # (group, ids, transfer, first slot, staging shape)
        for t in checked:
            gc = self._caches[t.group]
            shape = gc.host_page_shape if gc.relays else self._page(gc)
            for start, n in store_pieces(len(t.block_ids), self._bucket[t.group]):
                ids = t.block_ids[start : start + n].astype(np.int32)
                plan.append((t.group, ids, t, t.first_slot + start, (n, *shape)))
        return plan

    @staticmethod
    def _page(gc: GroupCaches) -> tuple[int, ...]:
        return (len(gc.arrays), *gc.layout.page_shape(tuple(gc.arrays[0].shape)))

    def fetch(self, plan: LoadPlan, load: FetchedLoad) -> None:
        """Reads a load's rows onto the devices, appending each piece (worker thread)."""
        pieces = load.pieces
        for group, ids, t, first, shape in plan:
            staged, buffers = self._fetch_piece(group, t, first, shape)
            if not self._on_cpu[group]:
                # A real H2D copy: the host buffers are free again.
                for b in buffers:
                    self._buffers.give(b)
                buffers = []
            pieces.append((group, ids, staged, buffers))

    def _fetch_piece(
        self, group: int, t: CheckedTransfer, first: int, shape: tuple[int, ...]
    ) -> tuple[jax.Array, list[np.ndarray]]:
        """The staging of one load piece on the caches' devices, and its host buffers."""
        gc = self._caches[group]
        dtype = gc.arrays[0].dtype
        # Sharded caches take their staging sharded like their page axes: each device
        # receives only its shard, read from the rows straight into its own buffer.
        if gc.relays:
            sharding = canonical_sharding(gc.arrays, gc.layout)
        else:
            sharding = pk.staging_sharding(gc.arrays, gc.layout)
        if sharding is not None and self._pool.moves_shards:

            def read(shards):
                self._pool.move_shards(group, t.chunk_ids, first, shape, dtype, shards, store=False)

            fetched = fetch_sharded(read, self._buffers.take, shape, dtype, sharding)
            if fetched is not None:
                return fetched
        rows = self._buffers.take((shape[0], gc.block_bytes))
        self._pool.read_blocks(group, t.chunk_ids, first, shape[0], rows)
        host = rows.view(dtype).reshape(shape)
        device = sharding or replicated(gc.arrays[0].sharding)
        return jax.block_until_ready(jax.device_put(host, device)), [rows]

    def scatter(self, load: FetchedLoad) -> Exception | None:
        """Scatters a load's fetched pieces into the caches (caller's thread), resuming
        at `load.applied`; returns the failure, if any, instead of raising it."""
        try:
            while load.applied < len(load.pieces):
                group, ids, staging, buffers = load.pieces[load.applied]
                gc = self._caches[group]
                # The scatter donates the old arrays: its result must be kept whatever
                # arrives in between, or the group's caches are gone.
                if gc.relays:  # the target's padding slots keep their bytes
                    staging = merge_into_pages(
                        gc.arrays, gc.layout, gc.canonical_kv_heads, ids, staging, self._kernel_kw
                    )
                with deferred_interrupts():
                    gc.arrays = pk.scatter_blocks(
                        gc.arrays, ids, staging, layout=gc.layout, **self._kernel_kw
                    )
                    load.applied += 1
                if buffers:
                    # On CPU the staging aliased the buffers (zero-copy device_put):
                    # reuse them only once the scatter has read them.
                    jax.block_until_ready(gc.arrays)
                    for b in buffers:
                        self._buffers.give(b)
        except Exception as exc:  # reported as a failed job, never dropped
            return exc
        return None
