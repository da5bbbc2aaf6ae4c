"""`KVOffloader`: one object a JAX serving stack drives to offload and reuse KV blocks.

It joins the scheduler side (a `HostStore`: which chunks exist, pins, eviction) and the
worker side (a `TransferEngine`: the bytes) for an engine that runs both in one process.

Call protocol (one thread at a time: a second thread calling in while another is inside
gets `OffloaderStateError`):

    with KVOffloader(config, caches) as off:
        job = off.store(block_hashes, block_ids)        # after a prefill: async copy out
        ...
        n = off.lookup(block_hashes)                    # leading blocks available on host
        job = off.load(block_hashes[:n], new_block_ids) # async copy in
        off.wait([job]); caches = off.caches()          # arrays now hold the prefix

A chunk is `blocks_per_chunk` consecutive blocks; its key is the engine's hash of the
chunk's last block plus the group index (the hash already covers the whole prefix).
Only whole chunks are stored or loaded.

Every job id `store` / `load` returns is reported exactly once, by `poll`, `wait` or
`close`, whatever happens in between (failures, `reset_cache`, interrupts); a call that
raises returns no id and leaves nothing behind. Life cycle: docs/architecture.md.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jax_kvoffload._offloader_checks import (
    OffloaderError,
    as_group_caches,
    budget_error,
    check_block_ids,
    check_caches,
    check_hashes,
)
from jax_kvoffload._offloader_stats import OffloaderAccounting
from jax_kvoffload.config import OffloadingConfig
from jax_kvoffload.errors import KVOffloadError, KVOffloadStateError, KVOffloadTypeError
from jax_kvoffload.stats import OffloadStats
from jax_kvoffload.store import HostStore, LookupResult, cpu_tier_capacity, make_offload_key
from jax_kvoffload.transfer import (
    Direction,
    GroupCaches,
    GroupTransfer,
    HostChunkPool,
    TransferEngine,
    TransferResult,
)
from jax_kvoffload.transfer.internals import (
    SingleCaller,
    check_distinct,
    check_index,
    deferred_interrupts,
)

__all__ = ["KVOffloader", "OffloaderError", "OffloaderStateError"]

logger = logging.getLogger(__name__)


class OffloaderStateError(KVOffloadStateError):
    """The offloader cannot take the call now (closed, or busy in another thread)."""


@dataclass
class _Job:
    direction: Direction
    group: int
    keys: list[bytes]
    generation: int  # the store's; a reset since means the keys are gone
    visible: bool = True  # False: the call that made it raised; settled silently


class KVOffloader:
    """Offloads KV chunks of a JAX engine to host memory and loads them back.

    Args:
      config: the `OffloadingConfig` (`build_offloading_config`).
      caches: group id -> `GroupCaches`, or one `GroupCaches` for the first group. The
        offloader owns the arrays afterwards: read them back with `caches(group)`. They
        must match the config: one array per layer (K and V each with
        `KVStacking.SEPARATE`), the config's dtype width and tokens per block.
      cpu_bytes_to_use: host budget; defaults to `config.extra_config["cpu_bytes_to_use"]`.
      eviction_policy: "lru" or "arc"; defaults to the extra config's, else "lru".
      backend, interpret: kernel backend for `pallas_kernels` ("auto" by platform).
      max_bucket: largest block count per kernel call.
      total_kv_heads: the model's KV heads; required with `config.canonical_layout`, where
        every array must be the global view (all heads, sharded over any mesh) so that its
        pages are the canonical, topology-free pages (docs/canonical.md).
    """

    def __init__(
        self,
        config: OffloadingConfig,
        caches: Mapping[int, GroupCaches] | GroupCaches,
        *,
        cpu_bytes_to_use: int | None = None,
        eviction_policy: str | None = None,
        backend: str = "auto",
        interpret: Any = False,
        max_bucket: int = 256,
        total_kv_heads: int | None = None,
    ) -> None:
        caches = as_group_caches(config, caches)
        check_caches(config, caches, total_kv_heads)
        self._groups = {g.group_id: g for g in config.groups}
        self._num_blocks = {g: gc.num_blocks for g, gc in caches.items()}  # set_caches keeps it
        self._bpc = config.cache.blocks_per_chunk
        if self._bpc < 1:
            raise OffloaderError(
                f"blocks_per_chunk={self._bpc}: 'block_size': 0 in the extra config gives "
                "chunks of no blocks; set 'blocks_per_chunk' >= 1"
            )
        self._store = _host_store(config, caches, cpu_bytes_to_use, eviction_policy)
        bytes_per_block = {g: gc.block_bytes for g, gc in caches.items()}
        self._pool = HostChunkPool(self._store.num_chunks, bytes_per_block, self._bpc)
        self._engine = TransferEngine(
            caches, self._pool, backend=backend, interpret=interpret, max_bucket=max_bucket
        )
        self._guard = SingleCaller("KVOffloader", OffloaderStateError)
        self._jobs: dict[int, _Job] = {}  # in flight (engine) or unsettled
        self._unsettled: deque[TransferResult] = deque()  # ended, store not yet told
        self._ready: dict[int, TransferResult] = {}  # settled, not yet returned
        self._ids = itertools.count(1)
        self._closed = False
        self.config = config
        tokens = {g.group_id: g.tokens_per_block for g in config.groups}
        self._stats = OffloaderAccounting(self._store, tokens, self._bpc)

    # -- queries ------------------------------------------------------------------

    @property
    def store_stats(self) -> Any:
        return self._store.get_stats()

    def stats(self) -> OffloadStats:
        """Cumulative counters and current occupancy (docs/observability.md); cheap,
        callable from any thread, also after `close`."""
        return self._stats.snapshot()

    @property
    def num_chunks(self) -> int:
        return self._store.num_chunks

    @property
    def host_bytes(self) -> int:
        return self._pool.nbytes

    @property
    def closed(self) -> bool:
        return self._closed

    def caches(self, group: int | None = None) -> list[jax.Array]:
        """The group's current device arrays (replaced by each completed load)."""
        with self._guard:
            return self._engine.arrays(self._group(group))

    def set_caches(self, arrays: Sequence[jax.Array], group: int | None = None) -> None:
        """Hands back the group's arrays after the engine wrote its own K/V into them.

        Start from `caches(group)` read after the last completed load (a load replaces
        the arrays); shapes and dtypes must stay the same (`TransferError` otherwise).
        The sharding may change: an engine that moves to another mesh passes its new
        global arrays, and chunks stored before load into them (with canonical pages,
        whatever the TP size; docs/canonical.md).
        """
        with self._guard:
            self._check_open()
            g = self._group(group)
            others = [a for h in self._groups if h != g for a in self._engine.arrays(h)]
            if isinstance(arrays, (list, tuple)) and all(isinstance(a, jax.Array) for a in arrays):
                check_distinct([*others, *arrays], "set_caches (all groups)")
            self._engine.set_arrays(g, arrays)

    def take_events(self) -> list[Any]:
        with self._guard:
            return self._store.take_events()

    def lookup(self, block_hashes: Sequence[bytes], *, group: int | None = None) -> int:
        """How many leading blocks can be loaded now (a multiple of blocks_per_chunk).

        Full-attention groups need every chunk of the prefix; a sliding-window group of
        W chunks needs only the last W before the prefix end, so the longest prefix
        whose trailing W chunks are all stored counts (and `load` loads those W).
        """
        with self._guard:
            self._check_open()
            g = self._group(group)
            hits = [
                self._store.lookup(make_offload_key(h, g)) is LookupResult.HIT
                for h in self._chunk_hashes(check_hashes(block_hashes))
            ]
            window = self._groups[g].sliding_window_size_in_chunks
            if window is None:
                n = next((i for i, hit in enumerate(hits) if not hit), len(hits))
            else:
                n = 0
                for end in range(len(hits), 0, -1):
                    if all(hits[max(0, end - window) : end]):
                        n = end
                        break
            self._stats.on_lookup(g, sum(hits), n * self._bpc)
            return n * self._bpc

    # -- transfers ------------------------------------------------------------------

    def store(
        self, block_hashes: Sequence[bytes], block_ids: Sequence[int], *, group: int | None = None
    ) -> int | None:
        """Starts offloading the whole chunks of a sequence; returns a job id.

        Chunks already stored are skipped; for a sliding-window group only the last W
        chunks are offered. Returns None when there is nothing to store or the host
        store cannot make room (the offer is dropped, as vLLM does).
        """
        with self._guard:
            self._check_open()
            g = self._group(group)
            hashes, ids = self._chunks(block_hashes, block_ids, g)
            keys = [make_offload_key(h, g) for h in hashes]
            window = self._groups[g].sliding_window_size_in_chunks
            offered = keys if window is None else keys[max(0, len(keys) - window) :]
            if not offered:
                return None
            return self._start_store(g, keys, ids, offered)

    def load(
        self, block_hashes: Sequence[bytes], block_ids: Sequence[int], *, group: int | None = None
    ) -> int | None:
        """Starts loading the chunks of `block_hashes` into `block_ids`; returns a job id.

        The chunks must be what `lookup` counted (their stores finished). A
        sliding-window group of W chunks loads only the last W chunks (and their
        blocks), as vLLM does; the other blocks are left as they are. The chunks stay
        pinned, so they cannot be evicted, until the job is reported.
        """
        with self._guard:
            self._check_open()
            g = self._group(group)
            hashes, ids = self._chunks(block_hashes, block_ids, g, unique=True)
            window = self._groups[g].sliding_window_size_in_chunks
            if window is not None:
                hashes, ids = hashes[max(0, len(hashes) - window) :], ids[-window:]
            if not hashes:
                return None
            return self._start_load(g, [make_offload_key(h, g) for h in hashes], ids)

    def poll(self) -> list[TransferResult]:
        """Results of jobs that ended since the last call; never blocks."""
        with self._guard:
            self._check_open()
            if self._unsettled or self._engine.has_finished():  # the common idle poll is cheap
                with deferred_interrupts():
                    self._settle(self._engine.get_finished())
            return self._take_ready(None)

    def wait(self, job_ids: Iterable[int | None] | None = None) -> list[TransferResult]:
        """Blocks until the jobs end; returns their results, in the order given.

        Default: every job not yet reported. Each id must be a job not yet reported,
        listed once (None entries, as `store` may return, are skipped); otherwise
        `OffloaderError` is raised before anything is collected. Interruptible: an
        interrupt while waiting loses nothing.
        """
        with self._guard:
            self._check_open()
            ids = None if job_ids is None else self._check_wait_ids(job_ids)
            waiting = {r.job_id for r in self._unsettled}
            in_engine = [i for i in (self._jobs if ids is None else ids) if i in self._jobs]
            in_engine = [i for i in in_engine if i not in waiting]
            self._engine.join(in_engine)  # blocks; may be interrupted, changes nothing
            with deferred_interrupts():
                self._settle(self._engine.wait(in_engine))
            return self._take_ready(ids)

    def reset_cache(self) -> None:
        """Forgets every stored chunk.

        Jobs in flight still end and are reported; a load among them delivers the bytes
        it was started for (the engine keeps new stores off the rows it still reads),
        a store among them is not recorded (its keys belong to the old generation).
        """
        with self._guard:
            self._check_open()
            with deferred_interrupts():
                self._store.reset_cache()

    def close(self) -> list[TransferResult]:
        """Waits for the jobs in flight, stops the transfer threads, and returns the
        results not yet reported. Idempotent (a later call returns what an interrupted
        one could not, else []); if interrupted, call it again. After it only `caches()`
        and the queries work."""
        with self._guard:
            if self._closed:  # normally []: what an interrupted close could not return
                return self._take_ready(None)
            self._engine.join()  # blocks; may be interrupted, changes nothing
            with deferred_interrupts():
                self._settle(self._engine.get_finished())
                self._engine.close()
                self._closed = True
            return self._take_ready(None)

    def __enter__(self) -> KVOffloader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals: arguments ----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise OffloaderStateError("the offloader is closed; build a new one")

    def _group(self, group: int | None) -> int:
        if group is None:
            if len(self._groups) != 1:
                raise OffloaderError(f"pass group=; this config has groups {sorted(self._groups)}")
            return next(iter(self._groups))
        g = check_index("group", group)
        if g not in self._groups:
            raise OffloaderError(f"group {g} is not offloaded; groups are {sorted(self._groups)}")
        return g

    def _chunk_hashes(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        # A chunk's key is its last block's hash: that hash covers the whole prefix.
        n = len(block_hashes) // self._bpc
        return [bytes(block_hashes[(c + 1) * self._bpc - 1]) for c in range(n)]

    def _chunks(
        self, block_hashes: object, block_ids: object, group: int, unique: bool = False
    ) -> tuple[list[bytes], list[list[int]]]:
        block_hashes = check_hashes(block_hashes)
        ids = check_block_ids(block_ids, len(block_hashes), self._num_blocks[group], group)
        hashes = self._chunk_hashes(block_hashes)
        whole = ids[: len(hashes) * self._bpc]
        if unique and np.unique(whole).size != whole.size:
            raise OffloaderError(f"group {group}: a load's block ids must be unique")
        return hashes, whole.reshape(len(hashes), self._bpc).tolist()

    def _check_wait_ids(self, job_ids: object) -> list[int]:
        if isinstance(job_ids, (str, bytes)) or not isinstance(job_ids, Iterable):
            raise KVOffloadTypeError(
                f"job_ids must be an iterable of job ids, got {type(job_ids).__name__}"
            )
        ids = [check_index("job id", j) for j in job_ids if j is not None]
        known = [i for i in ids if i in self._ready or self._visible(i)]
        unknown = [i for i in ids if i not in known]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if unknown or dup:
            what = "unknown or already reported" if unknown else "listed twice"
            raise OffloaderError(
                f"job ids {unknown or dup} are {what}; nothing was collected: pass each "
                "job not yet reported once"
            )
        return ids

    def _visible(self, job_id: int) -> bool:
        job = self._jobs.get(job_id)
        return job is not None and job.visible

    # -- internals: jobs ----------------------------------------------------------------

    def _start_store(
        self, g: int, keys: list[bytes], ids: list[list[int]], offered: list[bytes]
    ) -> int | None:
        job = None
        try:
            with deferred_interrupts():
                out = self._store.prepare_store(offered)
                if out is None or not out.keys_to_store:
                    return None
                job = self._record(Direction.STORE, g, list(out.keys_to_store))
            position = {k: i for i, k in enumerate(keys)}
            blocks = tuple(b for key in out.keys_to_store for b in ids[position[key]])
            transfer = GroupTransfer(g, blocks, tuple(out.chunk_ids))
            self._engine.submit_store(job, [transfer])
        except BaseException:
            if job is not None:
                self._abandon(job)
            raise
        return job

    def _start_load(self, g: int, keys: list[bytes], ids: list[list[int]]) -> int:
        job = None
        try:
            with deferred_interrupts():
                chunk_ids = self._store.prepare_load(keys)
                job = self._record(Direction.LOAD, g, keys)
            blocks = tuple(b for chunk in ids for b in chunk)
            self._engine.submit_load(job, [GroupTransfer(g, blocks, tuple(chunk_ids))])
        except BaseException:
            if job is not None:
                self._abandon(job)
            raise
        return job

    def _record(self, direction: Direction, g: int, keys: list[bytes]) -> int:
        job = next(self._ids)
        self._jobs[job] = _Job(direction, g, keys, self._store.cache_generation)
        return job

    def _abandon(self, job: int) -> None:
        """Undoes a job whose `store` / `load` call raised: the caller never got its id."""
        with deferred_interrupts():
            record = self._jobs[job]
            if self._engine.knows(job):
                # Submitted after all (the interrupt came later): it ends unreported; a
                # load must then not write blocks the caller believes untouched.
                record.visible = False
                if record.direction is Direction.LOAD:
                    self._engine.discard(job)
                return
            self._release(record, success=False)
            del self._jobs[job]

    def _release(self, record: _Job, success: bool) -> None:
        """Tells the store a job's keys are done with (unless a reset forgot them)."""
        if record.generation != self._store.cache_generation:
            return
        if record.direction is Direction.STORE:
            self._store.complete_store(record.keys, success=success)
        else:
            self._store.complete_load(record.keys)

    def _settle(self, results: list[TransferResult]) -> None:
        """Records ended jobs in the store, then queues the visible ones for the caller.

        Results wait in `_unsettled` until the store has been told: if that is
        interrupted, the next poll / wait / close picks up where this one stopped.
        """
        self._unsettled.extend(results)
        while self._unsettled:
            result = self._unsettled[0]
            record = self._jobs[result.job_id]
            try:
                self._release(record, result.success)
            except Exception:  # the store refused: log it, the job is still reported
                logger.exception("recording job %d in the host store failed", result.job_id)
            self._unsettled.popleft()
            del self._jobs[result.job_id]
            self._stats.on_job(record.direction is Direction.STORE, result)
            if record.visible:
                self._ready[result.job_id] = result

    def _take_ready(self, ids: list[int] | None) -> list[TransferResult]:
        if ids is None:
            out = list(self._ready.values())
            self._ready.clear()
            return out
        return [self._ready.pop(i) for i in ids]


def _host_store(
    config: OffloadingConfig,
    caches: dict[int, GroupCaches],
    cpu_bytes_to_use: Any,
    eviction_policy: str | None,
) -> HostStore:
    """The store sized as vLLM's CPU tier: one chunk id addresses a row in every group."""
    extra = config.extra_config
    budget = cpu_bytes_to_use if cpu_bytes_to_use is not None else extra.get("cpu_bytes_to_use")
    if budget is None:
        raise OffloaderError(
            "cpu_bytes_to_use is required: pass it or set it in kv_connector_extra_config"
        )
    # Global (canonical) arrays hold every rank's bytes in this one process: one copy.
    canonical = config.canonical_layout
    try:
        capacity = cpu_tier_capacity(
            budget,
            worker_kv_bytes_per_block=sum(gc.block_bytes for gc in caches.values()),
            blocks_per_chunk=config.cache.blocks_per_chunk,
            world_size=1 if canonical else config.parallel.world_size,
            replicated_layout=False if canonical else config.replicated_layout,
        )
        if capacity.num_chunks < 1:
            raise budget_error(budget, capacity.kv_bytes_per_chunk)
        return HostStore(
            capacity.num_chunks,
            eviction_policy=eviction_policy or extra.get("eviction_policy", "lru"),
            enable_events=config.enable_kv_cache_events,
        )
    except KVOffloadError:
        raise
    except TypeError as e:  # the store's own checks: their message, our error root
        raise KVOffloadTypeError(str(e)) from e
    except ValueError as e:
        raise OffloaderError(str(e)) from e
