"""The transfer engine's data path: device caches <-> staging <-> host chunk rows.

`TransferEngine` (_engine.py, over the job core) keeps the jobs; this holds
what moves a job's bytes: the store's gathers and row writes, the load's row reads,
H2D copies and scatters, and the reused host buffers of load staging. Which thread runs
each step is the engine's contract (its module docstring): gathers and scatters run on
the caller's thread, row writes and reads on the direction's worker thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict, cast

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from jax_kvoffload.hostmem import HostPool
from jax_kvoffload.transfer._buckets import store_pieces
from jax_kvoffload.transfer._caches import GroupCaches
from jax_kvoffload.transfer._job_checks import CheckedTransfer
from jax_kvoffload.transfer._rpa_pages import canonical_sharding, merge_into_pages, to_canonical
from jax_kvoffload.transfer._sharded_io import Shard, distinct_shards, fetch_sharded
from jax_kvoffload.transfer._staging import HostBuffers, bucket_for, replicated, to_host


class KernelOptions(TypedDict):
    """The `pallas_kernels` options of every gather and scatter of one engine."""

    backend: str
    interpret: object
    config: object


# One load piece to fetch: (group, block ids, transfer, first slot, staging shape, the
# group's `ScatterPlan`: where its ids and staging go ahead of the scatter).
LoadPlan = list[tuple[int, np.ndarray, CheckedTransfer, int, tuple[int, ...], pk.ScatterPlan]]
# One fetched load piece: (group, block ids, the ids on the devices or None, device
# staging, host buffers to give back).
LoadPieces = list[
    tuple[int, np.ndarray, jax.Array | None, jax.Array | np.ndarray, list[np.ndarray]]
]

# A sharded piece up to this size is read from the rows into one host buffer and put on
# the devices with the job's other arrays; larger ones go shard by shard
# (`_fetch_sharded`: one host copy per byte instead of two, but a device_put and an
# assembly more). 4-block loads of 0.25 MiB on 4 CPU devices: the sharded path's extra
# calls cost ~0.3 ms of a ~3 ms load (docs/benchmarks.md, tpu-inference, 2026-12-02).
WHOLE_PIECE_BYTES = 1 << 20
# One gathered store piece: (group, transfer, first slot, host array).
StorePieces = list[tuple[int, CheckedTransfer, int, jax.Array]]


class FetchedLoad:
    """A load's pieces on the devices: filled by the worker thread (`fetch`), scattered
    in order on the caller's thread (`scatter`). `applied` survives a `BaseException`
    out of a piece, so the next completion resumes where it stopped."""

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
        kernel_kw: KernelOptions,
        max_bucket: int,
        max_staging_bytes: int,
        *,
        device_path: bool = False,
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
        # Stores go to pinned host memory with a device_put (the accelerator's path;
        # `device_path` forces it on CPU, where the device array already is host memory).
        self._put_host = {g: device_path or not cpu for g, cpu in self._on_cpu.items()}
        self._plans: dict[int, pk.ScatterPlan] = {}  # per group, for its current arrays

    # -- stores -----------------------------------------------------------------------

    def gather(self, transfers: list[CheckedTransfer]) -> StorePieces:
        """Dispatches the gathers (and D2H copies) of a store, on the caller's thread."""
        staged = []  # (group, transfer, first slot, device staging)
        for t in transfers:
            gc = self._caches[t.group]
            for start, n in self._store_pieces(t):
                ids = t.block_ids[start : start + n].astype(np.int32)
                staging = pk.gather_blocks(gc.arrays, ids, layout=gc.layout, **self._kernel_kw)
                if gc.relays:  # canonical RPA pages: per-shard padding dropped on device
                    staging = to_canonical(gc.arrays, cast(int, gc.canonical_kv_heads), staging)
                staged.append((t.group, t, t.first_slot + start, staging))
        # The D2H copies of every piece in one device_put (one dispatch per job).
        hosts = to_host([s for *_, s in staged], [not self._put_host[g] for g, *_ in staged])
        return [(g, t, first, h) for (g, t, first, _), h in zip(staged, hosts, strict=True)]

    def _store_pieces(self, t: CheckedTransfer) -> list[tuple[int, int]]:
        per_chunk = self._pool.blocks_per_chunk if self._pool.adopts_rows else None
        return store_pieces(len(t.block_ids), self._bucket[t.group], t.first_slot, per_chunk)

    def write(self, staged: StorePieces) -> None:
        """Copies a store's gathered pieces into their chunk rows (worker thread); a pool
        that adopts rows keeps the host arrays themselves (no host copy)."""
        for group, t, first, host in staged:
            if self._pool.adopts_rows:
                jax.block_until_ready(host)  # the D2H copy has landed: it is the row
                self._pool.adopt_blocks(group, t.chunk_ids, first, None, host)
                continue
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
        plan = []  # (group, ids, transfer, first slot, staging shape, scatter plan)
        for t in checked:
            gc = self._caches[t.group]
            shape = gc.host_page_shape if gc.relays else self._page(gc)
            scatter = self._scatter_plan(t.group)
            for start, n in store_pieces(len(t.block_ids), self._bucket[t.group]):
                ids = t.block_ids[start : start + n].astype(np.int32)
                plan.append((t.group, ids, t, t.first_slot + start, (n, *shape), scatter))
        return plan

    def _scatter_plan(self, group: int) -> pk.ScatterPlan:
        """The group's `ScatterPlan` for its current arrays (made again when a
        `set_arrays` changed their sharding); caller's thread only."""
        gc = self._caches[group]
        plan = self._plans.get(group)
        if plan is None or not plan.matches(gc.arrays):
            plan = pk.plan_scatter(gc.arrays, layout=gc.layout, **self._kernel_kw)
            self._plans[group] = plan
        return plan

    @staticmethod
    def _staging_sharding(gc: GroupCaches, scatter: pk.ScatterPlan) -> jax.sharding.Sharding | None:
        """Where a load's staging is split like the caches' page axes, or None."""
        if gc.relays:
            return canonical_sharding(gc.arrays, gc.layout)
        return scatter.staging_sharding

    @classmethod
    def _staging_target(cls, gc: GroupCaches, scatter: pk.ScatterPlan) -> jax.sharding.Sharding:
        """Where a load's staging goes on the devices."""
        return cls._staging_sharding(gc, scatter) or replicated(gc.arrays[0].sharding)

    @staticmethod
    def _page(gc: GroupCaches) -> tuple[int, ...]:
        return (len(gc.arrays), *gc.layout.page_shape(tuple(gc.arrays[0].shape)))

    def fetch(self, plan: LoadPlan, load: FetchedLoad, *, settle: bool = True) -> None:
        """Reads a load's rows onto the devices, appending each piece (worker thread,
        or the caller's for an inline load).

        `settle`: wait for the copies to land (and give back the host buffers of real
        H2D copies) before returning; an inline load does not (its scatter follows at
        once, on the same thread, and gives the buffers back once it has read them).

        The host arrays of every piece, and its block ids, go to the devices in one
        `device_put` (one dispatch per job). A pool that adopts rows hands out its rows
        as they are (pinned host arrays on accelerators: no host copy); the others copy
        them into reused staging buffers first (`read_blocks`, one host copy per byte)."""
        hosts: list[object] = []  # every host array of the job, each once, in piece order
        targets: list[jax.sharding.Sharding] = []  # where each goes
        # (id of a row, target) -> index in hosts
        seen: dict[tuple[int, jax.sharding.Sharding], int] = {}
        # (group, ids, host index of the ids or None, what: [(host index, k0, k1)] of
        # rows | the host index of a staging buffer | a fetched sharded staging | an
        # inline load's host staging, buffers)
        pieces: list[
            tuple[
                int,
                np.ndarray,
                int | None,
                list[tuple[int, int, int]] | int | jax.Array | np.ndarray,
                list[np.ndarray],
            ]
        ] = []
        for group, ids, t, first, shape, scatter in plan:
            gc = self._caches[group]
            sharding = self._staging_sharding(gc, scatter)
            device = self._staging_target(gc, scatter)
            what: list[tuple[int, int, int]] | int | jax.Array
            buffers: list[np.ndarray] = []
            if self._pool.adopts_rows:
                what = []
                for row, k0, k1 in self._pool.row_sources(group, t.chunk_ids, first, shape[0]):
                    # A chunk that two pieces of the job share crosses the bus once.
                    at = seen.setdefault((id(row), device), len(hosts))
                    if at == len(hosts):
                        if isinstance(row, np.ndarray):  # a row of its own (partial stores)
                            row = row.view(gc.arrays[0].dtype).reshape(-1, *shape[1:])
                        hosts.append(row)
                        targets.append(device)
                    what.append((at, k0, k1))
            else:
                fetched = None
                if (
                    sharding is not None
                    and self._pool.moves_shards
                    and shape[0] * gc.block_bytes > WHOLE_PIECE_BYTES
                ):
                    fetched = self._fetch_sharded(group, t, first, shape, sharding)
                if fetched is not None:
                    what, buffers = fetched
                else:
                    rows = self._buffers.take((shape[0], gc.block_bytes))
                    self._pool.read_blocks(group, t.chunk_ids, first, shape[0], rows)
                    host = rows.view(gc.arrays[0].dtype).reshape(shape)
                    if not settle and not gc.relays:
                        # An inline load hands its host staging and numpy ids straight
                        # to the scatter, whose jit places them in its own dispatch: one
                        # device_put fewer (~0.3 ms after an idle pause on the CI VM).
                        pieces.append((group, ids, None, host, [rows]))
                        continue
                    what, buffers = len(hosts), [rows]
                    hosts.append(host)
                    targets.append(device)
            at_ids = None
            if scatter.ids_sharding is not None:  # with the job's other arrays
                at_ids = len(hosts)
                hosts.append(ids)
                targets.append(scatter.ids_sharding)
            pieces.append((group, ids, at_ids, what, buffers))
        placed = jax.device_put(hosts, targets) if hosts else []
        staged = []
        for group, ids, at_ids, got, buffers in pieces:
            placed_ids = None if at_ids is None else placed[at_ids]
            staging: jax.Array | np.ndarray
            if isinstance(got, list):  # rows as they are: cut and joined on the device
                parts = []
                for at, k0, k1 in got:
                    row = placed[at]
                    parts.append(row if (k0, k1) == (0, row.shape[0]) else row[k0:k1])
                staging = parts[0] if len(parts) == 1 else _join_bits(parts)
            elif isinstance(got, int):  # a staging buffer read from the rows
                staging = placed[got]
            else:  # fetched sharded (on the devices), or an inline load's host staging
                staging = got
            staged.append((group, ids, placed_ids, staging, buffers))
        if settle:
            jax.block_until_ready([s[3] for s in staged])
        for group, ids, placed_ids, staging, buffers in staged:
            if settle and not self._on_cpu[group]:
                # A real H2D copy: the host buffers are free again.
                for b in buffers:
                    self._buffers.give(b)
                buffers = []
            load.pieces.append((group, ids, placed_ids, staging, buffers))

    def _fetch_sharded(
        self,
        group: int,
        t: CheckedTransfer,
        first: int,
        shape: tuple[int, ...],
        sharding: jax.sharding.Sharding,
    ) -> tuple[jax.Array, list[np.ndarray]] | None:
        """Sharded caches take their staging sharded like their page axes: each device
        receives only its shard, read from the rows straight into its own buffer."""
        dtype = self._caches[group].arrays[0].dtype

        def read(shards: list[Shard]) -> None:
            self._pool.move_shards(group, t.chunk_ids, first, shape, dtype, shards, store=False)

        return fetch_sharded(read, self._buffers.take, shape, dtype, sharding)

    def scatter(self, load: FetchedLoad) -> Exception | None:
        """Scatters a load's fetched pieces into the caches (caller's thread), resuming
        at `load.applied`; returns the failure, if any, instead of raising it."""
        try:
            while load.applied < len(load.pieces):
                group, ids, placed_ids, staging, buffers = load.pieces[load.applied]
                gc = self._caches[group]
                plan = self._scatter_plan(group)
                if isinstance(staging, jax.Array) and (
                    staging.sharding.device_set != gc.arrays[0].sharding.device_set
                ):
                    # `set_arrays` moved the caches to other devices since the fetch:
                    # the staging follows them (a byte copy), or the scatter refuses it.
                    staging = jax.device_put(staging, self._staging_target(gc, plan))
                if gc.relays:  # the target's padding slots keep their bytes
                    staging = merge_into_pages(
                        gc.arrays,
                        gc.layout,
                        cast(int, gc.canonical_kv_heads),  # set where relays is
                        ids,
                        cast(jax.Array, staging),  # on the devices: relays never go inline
                        self._kernel_kw,
                    )
                if placed_ids is None or placed_ids.sharding != plan.ids_sharding:
                    placed_ids = None  # the arrays moved since the fetch: the host ids
                # The scatter donates the old arrays: its result must be kept, or the
                # group's caches are gone. The job core runs this with SIGINT held.
                gc.arrays = plan(gc.arrays, ids if placed_ids is None else placed_ids, staging)
                load.applied += 1
                if buffers:
                    # On CPU the staging aliased the buffers (zero-copy device_put), and
                    # an unsettled fetch's copies may still read them: reuse them only
                    # once the scatter has read them.
                    jax.block_until_ready(gc.arrays)
                    for b in buffers:
                        self._buffers.give(b)
        except Exception as exc:  # reported as a failed job, never dropped
            return exc
        return None


def _join_bits(parts: list[jax.Array]) -> jax.Array:
    """``jnp.concatenate(parts)`` bit for bit: joined as same-width unsigned integers, as
    XLA:CPU's concatenate of bf16 quiets NaN payloads (0xff99 -> 0xffc0)."""
    dtype = np.dtype(parts[0].dtype)
    if dtype.kind in "uib":
        return jnp.concatenate(parts)
    word = np.dtype(f"u{dtype.itemsize}")
    joined = jnp.concatenate([jax.lax.bitcast_convert_type(p, word) for p in parts])
    return jax.lax.bitcast_convert_type(joined, dtype)
