"""`StoreWorker`: the worker role, on our `TransferEngine`, with their runner contract.

It takes what their worker takes (`register_runner(runner)`, then per step their
`TPUOffloadConnectorMetadata` bound on the connector) and reports what theirs reports
(`KVOffloadConnectorStats`: `[chunk id, process index]` per finished chunk, the final
no-op saves in `get_finished`), so their scheduler cannot tell the two apart. The bytes
move through our kernels: one gather per layer-shape group and save job into a staging
array, device -> host into the pool rows the store's chunk ids address; loads come back
from those rows and are scattered in place, before the forward (their loads are
synchronous). The runner's arrays are read at each operation and written back after
it (scatters donate them), as their worker does.

A save that fails (or cannot be submitted) is reported done, after `Hub.fail_saves`
told the scheduler side to free its chunk; a load that fails raises (the forward would
read wrong KV otherwise), reported all the same so that its pins are given back. The
entry points hold SIGINT for their steps (`deferred_interrupts`; docs/architecture.md,
"Interrupts, in one place"): Ctrl-C cancels a load that waits, and loses no report.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from jax_kvoffload._interrupts import SingleCaller, deferred_interrupts
from jax_kvoffload.assembly import engine_pages, open_tiers
from jax_kvoffload.bridge.tpu_inference._errors import (
    TPUConnectorConfigError,
    TPUConnectorStateError,
)
from jax_kvoffload.bridge.tpu_inference._geometry import (
    LayerGroups,
    group_layers,
    namespace_config,
)
from jax_kvoffload.bridge.tpu_inference._hub import Hub
from jax_kvoffload.errors import KVOffloadError
from jax_kvoffload.hostmem import build_host_pool
from jax_kvoffload.transfer import Direction, GroupCaches, GroupTransfer, TransferEngine

__all__ = ["StoreWorker"]

logger = logging.getLogger(__name__)

# Loads up to this size read their rows on the caller's thread (`submit_load(inline=)`):
# the forward waits for them anyway, and two thread handoffs were ~10% of a 0.25 MiB
# load on the 2-core CI VM. Larger ones keep the load thread, whose wait Ctrl-C cancels.
INLINE_LOAD_BYTES = 4 << 20


class StoreWorker:
    """The worker side of our `TPUOffloadConnector` (see the module docstring).

    Args:
      hub: the engine's shared parts (the store, built by the scheduler role).
      connector: the connector the metadata is bound on (`_get_connector_metadata`).
      stats: a fresh `KVOffloadConnectorStats` (their type: their scheduler asserts it).
      model, block_size: the engine's model name and block size (the tiers' namespace).
    """

    def __init__(self, hub: Hub, connector: Any, stats: Any, model: str, block_size: int) -> None:
        self._hub = hub
        self._connector = connector
        self._stats = stats
        self._model = model
        self._block_size = block_size
        self._runner: Any = None
        self._groups: LayerGroups | None = None
        self._engine: TransferEngine | None = None
        self._block_bytes = 0  # one block of every layer, all groups
        self._ids = itertools.count(1)
        self._saves: dict[int, tuple[str, list[int]]] = {}  # job -> (request, chunks)
        self._loads: dict[int, list[tuple[str, list[int]]]] = {}  # job -> [(request, chunks)]
        self._finished: set[str] = set()
        self._saved_this_step = False
        self._loaded: Any = None  # the metadata whose loads were taken (held: its id)
        # Their worker is driven from one thread; a second caller is refused before it
        # changes anything (it raced the first on the maps and the engine's arrays).
        self._guard = SingleCaller("StoreWorker", TPUConnectorStateError)

    # -- their runner contract ----------------------------------------------------------

    def register_runner(self, runner: Any) -> None:
        with self._guard:
            self._register_runner(runner)

    def _register_runner(self, runner: Any) -> None:
        caches = list(runner.kv_caches)
        groups = group_layers(caches)
        if self._engine is not None:
            self._register_again(runner, caches, groups)
            return
        host = self._hub.host
        if host.secondary_tiers and self._hub.store is None:
            raise TPUConnectorStateError(
                "secondary_tiers need the engine's scheduler-role connector in this process "
                "(the tiers read and fill the host rows for the scheduler's store), as "
                "tpu-inference's single-host UniProcExecutor runs it; none was built here"
            )
        if host.secondary_tiers and len(groups.layers) > 1:
            raise TPUConnectorConfigError(
                "secondary_tiers",
                [t.type for t in host.secondary_tiers],
                f"the model's layers have {len(groups.layers)} page shapes; secondary tiers "
                "serve one (drop secondary_tiers for hybrid models)",
            )
        gcs = {
            g: GroupCaches(groups.arrays(caches, g), groups.layout)
            for g in range(len(groups.layers))
        }
        pool, _ = build_host_pool(
            self._hub.num_chunks,
            {g: gc.block_bytes for g, gc in gcs.items()},
            1,
            kind=host.host_pool,
            # "auto" is then "pinned" on a TPU: the D2H copies land in their rows.
            accelerator=any(gc.on_accelerator for gc in gcs.values()),
        )
        engine = TransferEngine(gcs, pool)
        tiers: tuple = ()
        try:
            if host.secondary_tiers:
                shape = groups.shapes[0]
                config = namespace_config(
                    self._model,
                    self._block_size,
                    caches[0].dtype,
                    shape,
                    len(caches),
                    self._hub.num_chunks * gcs[0].block_bytes,
                )
                tiers = open_tiers(config, host, pages=engine_pages(gcs))
            # The hub's and the worker's, together: a Ctrl-C between them left the hub's
            # engine unknown to the worker, and a retry built another (never closed).
            with deferred_interrupts():
                self._hub.attach_worker(pool, engine, tiers, len(gcs))
                self._runner, self._groups, self._engine = runner, groups, engine
                self._block_bytes = sum(gc.block_bytes for gc in gcs.values())
        except BaseException:
            if self._engine is not engine:  # built, never attached: nobody would close it
                for tier in tiers:
                    tier.close()
                engine.close()
            raise

    def _register_again(self, runner: Any, caches: list[Any], groups: LayerGroups) -> None:
        """A second `register_runner` (a runner rebuilt in place): the pool's rows hold
        the chunks the store lists, so the worker keeps pool and engine and takes the
        new runner's arrays if they have the same geometry; a new pool would serve those
        chunks as zeros."""
        engine, old = self._engine_and_groups()
        held = [(tuple(a.shape), a.dtype) for g in range(len(old.layers)) for a in engine.arrays(g)]
        new = [
            (tuple(a.shape), a.dtype)
            for g in range(len(groups.layers))
            for a in groups.arrays(caches, g)
        ]
        if groups.layers != old.layers or held != new:
            raise TPUConnectorStateError(
                "register_runner was called again with caches of another geometry "
                f"({sorted(set(new), key=str)} instead of {sorted(set(held), key=str)}): the "
                "host chunks hold the first caches' pages; build a new connector (engine) "
                "for the new caches"
            )
        self._runner, self._groups = runner, groups

    # -- per step -------------------------------------------------------------------------

    def _metadata(self, meta: Any = None) -> list[Any]:
        if meta is None:
            meta = self._connector._get_connector_metadata()
        return list(getattr(meta, "requests_meta", None) or [])

    def _engine_and_groups(self) -> tuple[TransferEngine, LayerGroups]:
        if self._engine is None or self._groups is None:
            raise TPUConnectorStateError(
                "register_runner(runner) was not called: the worker has no caches"
            )
        return self._engine, self._groups

    def _sync_in(self) -> list[Any]:
        """Hands the runner's current arrays to the engine (they change every step)."""
        engine, groups = self._engine_and_groups()
        caches = list(self._runner.kv_caches)
        for g in range(len(groups.layers)):
            arrays = groups.arrays(caches, g)
            held = engine.arrays(g)
            # Unchanged since our last operation (no forward in between): already checked.
            same = len(held) == len(arrays) and all(
                a is b for a, b in zip(held, arrays, strict=True)
            )
            if not same:
                engine.set_arrays(g, arrays)
        return caches

    def _sync_out(self, caches: list[Any]) -> None:
        engine, groups = self._engine_and_groups()
        for g in range(len(groups.layers)):
            groups.write_back(caches, g, engine.arrays(g))
        self._runner.kv_caches = caches

    def start_load_kv(self) -> None:
        """Loads the step's chunks into their blocks and waits for them (their loads
        are synchronous: the forward reads them next).

        Interrupts (docs/architecture.md, "Interrupts, in one place"): the wait is
        interruptible and changes nothing; Ctrl-C there cancels the load (`discard`: it
        never writes its blocks) and propagates. Every other step runs with SIGINT
        held: the load submitted and recorded, or neither; its result taken, the caches
        written back and the load reported, whole. A load that did not finish (failed,
        or cancelled: then by the next `get_kv_connector_stats` once it ended) is
        reported all the same, so that the scheduler side gives back its pins; its
        blocks hold unspecified bytes. So is a load refused before any copy (unpaired
        blocks and chunks, before `register_runner`): every load of the step, then.
        One caller at a time: a second thread's call raises `TPUConnectorStateError`
        (on every entry point) before it changes anything.
        """
        with self._guard:
            self._saved_this_step = False
            self._start_load_kv()

    def _start_load_kv(self) -> None:
        job = next(self._ids)
        caches: list[Any] = []
        try:
            # One held step: the loads checked, submitted and recorded, or given back
            # (reported) without a copy; a Ctrl-C held here arrives at its end, below.
            with deferred_interrupts():
                meta = self._connector._get_connector_metadata()
                if meta is not None and meta is self._loaded:
                    return  # loaded (or given back) already: a second load reported twice
                self._loaded = meta
                loads = [m for m in self._metadata(meta) if _has_load(m)]
                if not loads:
                    return
                record = [(m.req_id, list(m.load_spec.src_chunks)) for m in loads]
                try:
                    engine, groups = self._engine_and_groups()
                    _check_loads(loads)
                    blocks = tuple(b for m in loads for b in m.load_spec.dst_blocks)
                    chunks = tuple(c for m in loads for c in m.load_spec.src_chunks)
                    caches = self._sync_in()
                    engine.submit_load(
                        job,
                        [GroupTransfer(g, blocks, chunks) for g in range(len(groups.layers))],
                        inline=len(blocks) * self._block_bytes <= INLINE_LOAD_BYTES,
                    )
                except Exception:
                    self._record_loads(record)  # nothing was queued: its pins go back now
                    raise
                self._loads[job] = record
            engine.join([job])  # blocks; may be interrupted, changes nothing
            # Inside the try: a Ctrl-C between the join and this block cancels the load
            # as one in the join does (outside it, the load stayed queued and its later
            # completion donated the runner's arrays).
            with deferred_interrupts():
                (result,) = engine.wait([job])  # its copies ended: the scatter, at once
                del self._loads[job]
                self._sync_out(caches)
                self._record_loads(record)
        except BaseException:
            if job in self._loads:
                with deferred_interrupts():
                    # Cancelled: it never scatters (the caches stay the runner's);
                    # `_collect` reports it once it ended (its copies may still run).
                    engine.discard(job)
                    self._sync_out(caches)
            raise
        if not result.success:
            raise TPUConnectorStateError(
                f"loading chunks {list(chunks)} into blocks {list(blocks)} failed: "
                f"{result.error}; the forward would read wrong KV"
            )

    def _record_loads(self, record: list[tuple[str, list[int]]]) -> None:
        for req, chunk_ids in record:
            self._stats.record_load(req=req, loaded_chunk_ids=chunk_ids)

    def start_save_kv(self) -> None:
        """Starts the step's saves once (their `wait_for_save` and `get_finished` both
        call it); the gathers are dispatched now, the copies finish in the background.

        A request whose save cannot be submitted (its `src_blocks` and `dst_chunks` do
        not pair one to one, chunks without blocks included, a chunk is named twice, or
        the engine refuses them, e.g. a block out of range; also every request before
        `register_runner`)
        fails alone, as in their worker (non-batched, their default: it logs the request
        and saves the others); unlike theirs, its chunks are reported failed
        (`Hub.fail_saves`), so that the scheduler side frees them instead of keeping
        them write-pending. The step's saves are submitted and recorded with SIGINT
        held (whole, or not at all: an interrupt arrives after them).
        """
        with self._guard:
            self._start_save_kv()

    def _start_save_kv(self) -> None:
        if self._saved_this_step:
            return
        with deferred_interrupts():  # the step's saves submitted and recorded, whole
            saves = []
            for m in self._metadata():
                spec = m.save_spec
                if spec is None:
                    continue
                if spec.skip_save:
                    if spec.is_final_save:
                        self._finished.add(m.req_id)
                    continue
                if spec.src_blocks or spec.dst_chunks:  # chunks alone: failed below
                    saves.append(m)
            self._saved_this_step = True
            if not saves:
                return
            if self._engine is None:
                for m in saves:  # their chunks are freed, not write-pending for good
                    self._fail_save(m.req_id, list(m.save_spec.dst_chunks), "no runner")
            engine, groups = self._engine_and_groups()
            try:
                caches = self._sync_in()
            except KVOffloadError as exc:  # the runner's arrays refused: nothing saved
                for m in saves:
                    self._fail_save(m.req_id, list(m.save_spec.dst_chunks), str(exc))
                raise
            try:
                for m in saves:
                    self._submit_save(engine, len(groups.layers), m)
            finally:
                self._sync_out(caches)

    def _submit_save(self, engine: TransferEngine, num_groups: int, m: Any) -> None:
        blocks, chunks = tuple(m.save_spec.src_blocks), tuple(m.save_spec.dst_chunks)
        if len(set(chunks)) != len(chunks):
            # Two blocks into one chunk: it would hold either, reported saved as one.
            self._fail_save(
                m.req_id,
                sorted(set(chunks)),
                f"save_spec names dst_chunks {list(chunks)}, some twice; each chunk holds "
                "one block",
            )
            return
        if len(blocks) != len(chunks):
            # The engine alone would accept more chunks than blocks (it checks that the
            # chunks hold the blocks) and report the unwritten chunks saved.
            self._fail_save(
                m.req_id,
                list(chunks),
                f"save_spec has {len(blocks)} src_blocks and {len(chunks)} dst_chunks; a "
                "chunk holds one block, so they must pair one to one (their scheduler's "
                "_prepare_save_spec builds them so)",
            )
            return
        job = next(self._ids)
        try:
            engine.submit_store(job, [GroupTransfer(g, blocks, chunks) for g in range(num_groups)])
        except KVOffloadError as exc:  # refused before anything was queued
            self._fail_save(m.req_id, list(chunks), str(exc))
            return
        self._saves[job] = (m.req_id, list(chunks))

    def _fail_save(self, req: str, chunks: list[int], why: str) -> None:
        logger.warning("request %s: not saving chunks %s: %s", req, chunks, why)
        self._hub.fail_saves(chunks)
        self._stats.record_save(req=req, saved_chunk_ids=chunks)

    def _collect(self) -> None:
        """Reports the saves (and the cancelled loads) that ended; SIGINT held, so that
        a result taken from the engine is reported."""
        if self._engine is None or not self._engine.has_finished():
            return
        with deferred_interrupts():
            for result in self._engine.get_finished():
                if result.direction is Direction.LOAD:
                    record = self._loads.pop(result.job_id, None)
                    if record is not None:  # cancelled by an interrupt, ended now
                        self._record_loads(record)
                    continue
                if result.job_id not in self._saves:
                    continue
                req, chunks = self._saves.pop(result.job_id)
                if not result.success:
                    logger.warning("saving chunks %s of %s failed: %s", chunks, req, result.error)
                    self._hub.fail_saves(chunks)
                self._stats.record_save(req=req, saved_chunk_ids=chunks)

    def get_kv_connector_stats(self) -> Any:
        with self._guard:
            self._collect()
        if self._stats.is_empty():
            return None
        return self._stats.clone_and_reset()

    def get_finished(self) -> tuple[set[str], set[str]]:
        with self._guard:
            self._start_save_kv()
            self._collect()
            finished, self._finished = self._finished, set()
            return finished, set()


def _has_load(m: Any) -> bool:
    spec = m.load_spec  # chunks without blocks: pinned all the same, refused below
    return spec is not None and spec.can_load and bool(spec.dst_blocks or spec.src_chunks)


def _check_loads(loads: list[Any]) -> None:
    for m in loads:  # one chunk per block: a mismatch would shift every later pair
        spec = m.load_spec
        if len(spec.dst_blocks) != len(spec.src_chunks):
            raise TPUConnectorStateError(
                f"request {m.req_id}: load_spec has {len(spec.dst_blocks)} dst_blocks "
                f"and {len(spec.src_chunks)} src_chunks; a chunk holds one block, so "
                "they must pair one to one (nothing was loaded)"
            )
