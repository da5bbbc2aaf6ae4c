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

A save that fails is reported done, after `Hub.fail_saves` told the scheduler side to
free its chunk; a load that fails raises (the forward would read wrong KV otherwise).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

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
from jax_kvoffload.hostmem import build_host_pool
from jax_kvoffload.transfer import Direction, GroupCaches, GroupTransfer, TransferEngine

__all__ = ["StoreWorker"]

logger = logging.getLogger(__name__)


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
        self._ids = itertools.count(1)
        self._saves: dict[int, tuple[str, list[int]]] = {}  # job -> (request, chunks)
        self._finished: set[str] = set()
        self._saved_this_step = False

    # -- their runner contract ----------------------------------------------------------

    def register_runner(self, runner: Any) -> None:
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
        )
        engine = TransferEngine(gcs, pool)
        tiers: tuple = ()
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
        self._hub.attach_worker(pool, engine, tiers, len(gcs))
        self._runner, self._groups, self._engine = runner, groups, engine

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

    def _metadata(self) -> list[Any]:
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
        self._saved_this_step = False
        loads = [
            m
            for m in self._metadata()
            if m.load_spec is not None and m.load_spec.can_load and m.load_spec.dst_blocks
        ]
        if not loads:
            return
        engine, groups = self._engine_and_groups()
        for m in loads:  # one chunk per block: a mismatch would shift every later pair
            spec = m.load_spec
            if len(spec.dst_blocks) != len(spec.src_chunks):
                raise TPUConnectorStateError(
                    f"request {m.req_id}: load_spec has {len(spec.dst_blocks)} dst_blocks "
                    f"and {len(spec.src_chunks)} src_chunks; a chunk holds one block, so "
                    "they must pair one to one (nothing was loaded)"
                )
        blocks = tuple(b for m in loads for b in m.load_spec.dst_blocks)
        chunks = tuple(c for m in loads for c in m.load_spec.src_chunks)
        caches = self._sync_in()
        job = next(self._ids)
        try:
            engine.submit_load(
                job, [GroupTransfer(g, blocks, chunks) for g in range(len(groups.layers))]
            )
            (result,) = engine.wait([job])
        finally:
            self._sync_out(caches)
        if not result.success:
            raise TPUConnectorStateError(
                f"loading chunks {list(chunks)} into blocks {list(blocks)} failed: "
                f"{result.error}; the forward would read wrong KV"
            )
        for m in loads:
            self._stats.record_load(req=m.req_id, loaded_chunk_ids=list(m.load_spec.src_chunks))

    def start_save_kv(self) -> None:
        """Starts the step's saves once (their `wait_for_save` and `get_finished` both
        call it); the gathers are dispatched now, the copies finish in the background."""
        if self._saved_this_step:
            return
        self._saved_this_step = True
        saves = []
        for m in self._metadata():
            spec = m.save_spec
            if spec is None:
                continue
            if spec.skip_save:
                if spec.is_final_save:
                    self._finished.add(m.req_id)
                continue
            if spec.src_blocks:
                saves.append(m)
        if not saves:
            return
        engine, groups = self._engine_and_groups()
        caches = self._sync_in()
        try:
            for m in saves:
                blocks, chunks = tuple(m.save_spec.src_blocks), tuple(m.save_spec.dst_chunks)
                job = next(self._ids)
                transfers = [GroupTransfer(g, blocks, chunks) for g in range(len(groups.layers))]
                engine.submit_store(job, transfers)
                self._saves[job] = (m.req_id, list(chunks))
        finally:
            self._sync_out(caches)

    def _collect(self) -> None:
        if self._engine is None or not self._engine.has_finished():
            return
        for result in self._engine.get_finished():
            if result.direction is not Direction.STORE or result.job_id not in self._saves:
                continue
            req, chunks = self._saves.pop(result.job_id)
            if not result.success:
                logger.warning("saving chunks %s of %s failed: %s", chunks, req, result.error)
                self._hub.fail_saves(chunks)
            self._stats.record_save(req=req, saved_chunk_ids=chunks)

    def get_kv_connector_stats(self) -> Any:
        self._collect()
        if self._stats.is_empty():
            return None
        return self._stats.clone_and_reset()

    def get_finished(self) -> tuple[set[str], set[str]]:
        self.start_save_kv()
        self._collect()
        finished, self._finished = self._finished, set()
        return finished, set()
