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

Interrupt safety is made here: each call is a sequence of waits (interruptible, they
change nothing) and steps that change the store, the job book or the tier path (run
with SIGINT held, `deferred_interrupts`); the parts it calls hold no signal themselves
(docs/architecture.md, "Interrupts, in one place").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import cast

import jax

from jax_kvoffload._interrupts import SingleCaller, deferred_interrupts
from jax_kvoffload.assembly import engine_pages
from jax_kvoffload.config import OffloadingConfig
from jax_kvoffload.config.internals import checked_arguments
from jax_kvoffload.errors import KVOffloadStateError
from jax_kvoffload.offloader._accounting import OffloaderAccounting
from jax_kvoffload.offloader._arguments import OffloaderArguments
from jax_kvoffload.offloader._cache_checks import check_caches
from jax_kvoffload.offloader._cascade import TierPath, prefix_chunks
from jax_kvoffload.offloader._checks import (
    OffloaderError,
    as_group_caches,
    assemble,
    check_flag,
    check_timeout,
    not_loadable,
)
from jax_kvoffload.offloader._chunking import store_transfer
from jax_kvoffload.offloader._job_book import JobBook
from jax_kvoffload.offloader._load_plan import locate_missing, prepare_load
from jax_kvoffload.offloader._tier_stats import TierPathStats
from jax_kvoffload.stats import OffloadStats
from jax_kvoffload.store import (
    KeyNotReadyError,
    KeyNotStoredError,
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    StoreStats,
)
from jax_kvoffload.tiers import SecondaryTier, namespace_digest
from jax_kvoffload.transfer import (
    Direction,
    GroupCaches,
    GroupTransfer,
    TransferEngine,
    TransferResult,
)

__all__ = ["KVOffloader", "OffloaderError", "OffloaderStateError"]


class OffloaderStateError(KVOffloadStateError):
    """The offloader cannot take the call now (closed, or busy in another thread)."""


@checked_arguments
class KVOffloader:
    """Offloads KV chunks of a JAX engine to host memory (and secondary tiers) and
    loads them back.

    Args:
      config: the `OffloadingConfig` (`build_offloading_config`). Its extra config's
        host-tier keys (`cpu_bytes_to_use`, `eviction_policy`, `secondary_tiers`, ...;
        `jax_kvoffload.config.host_tier_config`) size and shape the host tier.
      caches: group id -> `GroupCaches`, or one `GroupCaches` for the first group. The
        offloader owns the arrays afterwards: read them back with `caches(group)`. They
        must match the config (`CacheConfigMismatchError` otherwise; docs/errors.md):
        one array per layer (K and V each with `KVStacking.SEPARATE`), the config's
        dtype (or uint words of its width), tokens per block and bytes per block.
      cpu_bytes_to_use: host budget; defaults to the extra config's `cpu_bytes_to_use`.
      eviction_policy: "lru" or "arc"; defaults to the extra config's, else "lru".
      host_pool: "numpy" (rows allocated once) or "pinned" (the host arrays of the
        device-to-host copies are the rows: no host copy), or "auto" ("pinned" for
        caches on an accelerator, else "numpy"); default the extra config's
        `host_pool`, else "auto".
      tiers: secondary tiers already opened, used instead of the extra config's
        `secondary_tiers` (the caller closes them; the offloader closes those it opens).
      backend, interpret: kernel backend for `pallas_kernels` ("auto" by platform).
      max_bucket: largest block count per kernel call.
      total_kv_heads: the model's KV heads; required with `config.canonical_layout`, where
        every array must be the global view (all heads, sharded over any mesh) so that its
        pages are the canonical, topology-free pages (docs/canonical.md). With RPA
        caches it makes the heads check exact (docs/errors.md, "Caches against the
        config": a padded array's bytes do not state its heads).

    With secondary tiers (docs/tiers.md): completed stores cascade to every tier,
    `lookup` sees the host, then the tiers (and promotes what it counts into the host),
    `load` promotes tier hits it is given before loading.

    It owns its parts: the host store and pool, the `TransferEngine`, the tier path
    (`TierPath`: cascades and promotions), the job book (`JobBook`: each job until it
    is reported once), the accounting behind `stats()` and the checks of each call's
    arguments (`OffloaderArguments`: group, chunk keys, block rows). Each is given the others it
    needs when it is built; none calls back into the offloader.
    """

    def __init__(
        self,
        config: OffloadingConfig,
        caches: Mapping[int, GroupCaches] | GroupCaches,
        *,
        cpu_bytes_to_use: int | None = None,
        eviction_policy: str | None = None,
        host_pool: str | None = None,
        tiers: Sequence[SecondaryTier] | None = None,
        backend: str = "auto",
        interpret: object = False,
        max_bucket: int = 256,
        total_kv_heads: int | None = None,
    ) -> None:
        caches = check_caches(config, as_group_caches(config, caches), total_kv_heads)
        self._args = OffloaderArguments(config, caches)
        self._bpc = self._args.bpc
        parts = assemble(config, caches, cpu_bytes_to_use, eviction_policy, host_pool, tiers)
        self._store, self._pool = parts.store, parts.pool
        try:
            self._engine = TransferEngine(
                caches, self._pool, backend=backend, interpret=interpret, max_bucket=max_bucket
            )
        except BaseException:  # on any exit: the tiers it opened are closed, not leaked
            if tiers is None:
                for tier in parts.tiers:
                    tier.close()
            raise
        self._tiers = TierPath(parts.tiers, self._store, self._pool) if parts.tiers else None
        self._own_tiers = tiers is None
        self._tier_namespace = namespace_digest(config, pages=engine_pages(caches))
        self._guard = SingleCaller("KVOffloader", OffloaderStateError)
        tokens = {g.group_id: g.tokens_per_block for g in config.groups}
        tier_counts = None if self._tiers is None else self._tiers.counts.summary
        self._stats = OffloaderAccounting(
            self._store, tokens, self._bpc, tier_counts, self._pool.host_copies
        )
        self._jobs = JobBook(self._store, self._engine, self._tiers, self._stats)
        self._closed = False
        self.config = config

    # -- queries ------------------------------------------------------------------

    def stats(self) -> OffloadStats:
        """Cumulative counters and current occupancy (docs/observability.md); cheap,
        callable from any thread, also after `close`."""
        return self._stats.snapshot()

    @property
    def store_stats(self) -> StoreStats:
        return self._store.get_stats()

    @property
    def num_chunks(self) -> int:
        return self._store.num_chunks

    @property
    def host_bytes(self) -> int:
        return self._pool.nbytes

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def tier_stats(self) -> tuple[TierPathStats, ...]:
        """Per secondary tier: cascaded, promoted, dropped, bytes, seconds (docs/tiers.md)."""
        return () if self._tiers is None else self._tiers.counts.stats()

    @property
    def tier_namespace(self) -> bytes:
        """The namespace of the entries this engine's tiers hold: its config and how its
        caches lay out a page (`namespace_digest(config, pages=engine_pages(caches))`);
        open tiers passed as `tiers=` in it."""
        return self._tier_namespace

    @property
    def secondary_tiers(self) -> tuple[SecondaryTier, ...]:
        """The tiers behind the host store (their own `stats()`), in lookup order."""
        return () if self._tiers is None else self._tiers.tiers

    def caches(self, group: int | None = None) -> list[jax.Array]:
        """The group's current device arrays (replaced by each completed load)."""
        with self._guard:
            return self._engine.arrays(self._args.group(group))

    def set_caches(self, arrays: Sequence[jax.Array], group: int | None = None) -> None:
        """Hands back the group's arrays after the engine wrote its own K/V into them.

        Start from `caches(group)` read after the last completed load (a load replaces
        the arrays); shapes and dtypes must stay the same (`TransferError` otherwise;
        `CacheConfigMismatchError` for a dtype other than the config's).
        The sharding may change: an engine that moves to another mesh passes its new
        global arrays, and chunks stored before load into them (with canonical pages,
        whatever the TP size; docs/canonical.md).
        """
        with self._guard:
            self._check_open()
            g = self._args.group(group)
            others = [a for h in self._args.group_ids if h != g for a in self._engine.arrays(h)]
            self._args.check_set_caches(g, arrays, others)
            self._engine.set_arrays(g, arrays)

    def take_events(self) -> list[OffloadingEvent]:
        with self._guard:
            return self._store.take_events()

    def lookup(
        self, block_hashes: Sequence[bytes], *, group: int | None = None, wait: bool = True
    ) -> int:
        """How many leading blocks can be loaded now (a multiple of blocks_per_chunk).

        Full-attention groups need every chunk of the prefix; a sliding-window group of
        W chunks needs only the last W before the prefix end, so the longest prefix
        whose trailing W chunks are all stored counts (and `load` loads those W).

        With secondary tiers, chunks the host lacks are looked for in the tiers and
        promoted into host chunks; `wait=True` waits for those promotions (bounded by
        the tiers' timeouts), so the count is what `load` will load. `wait=False`
        returns the host's count at once and lets the promotions finish in the
        background (vLLM's asynchronous lookup): ask again later.
        """
        with self._guard:
            self._check_open()
            g = self._args.group(group)
            wait = check_flag("wait", wait)
            keys = self._args.lookup_keys(g, block_hashes)
            window = self._args.window(g)
            if self._tiers is not None:
                n, found = self._tier_lookup(g, keys, window, wait)
                self._stats.on_lookup(g, found, n * self._bpc)  # in the host or a tier
                return n * self._bpc
            hits = [self._store.lookup(k) is LookupResult.HIT for k in keys]
            n = prefix_chunks(hits, window)
            self._stats.on_lookup(g, sum(hits), n * self._bpc)
            return n * self._bpc

    def flush_tiers(self, timeout: float | None = None) -> bool:
        """Waits until every cascade and promotion in flight has ended (e.g. before a
        process exits, so that what it stored is in the tiers); False on timeout.
        A store still in the transfer engine has no cascade yet: `wait()` for it first
        (`close()` waits for both). `timeout`: seconds or None (no bound); NaN is
        refused. Interruptible. Without tiers: True at once."""
        with self._guard:
            self._check_open()
            timeout = check_timeout("timeout", timeout)
            if self._tiers is None:
                return True
            if self._jobs.has_unsettled or self._engine.has_finished():
                with deferred_interrupts():  # completed stores cascade first
                    self._jobs.settle(self._engine.get_finished())
            done = self._tiers.join(timeout=timeout)  # blocks; changes nothing
            with deferred_interrupts():
                self._tiers.process()
            return done

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
            g = self._args.group(group)
            keys, ids, offered = self._args.store_chunks(g, block_hashes, block_ids)
            if not offered:
                return None
            if self._tiers is not None:
                # Finished cascades unpin their chunks first, so the store can evict
                # them (vLLM's tiering prepare_store polls its tiers for this reason).
                with deferred_interrupts():
                    self._tiers.process()
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
            g = self._args.group(group)
            keys, ids, skipped = self._args.load_chunks(g, block_hashes, block_ids)
            if not keys:
                return None
            try:
                return self._start_load(g, keys, ids)
            except (KeyNotStoredError, KeyNotReadyError) as e:
                if e.key not in keys:
                    raise
                chunk = skipped + keys.index(e.key)
                raise not_loadable(e, g, (chunk + 1) * self._bpc - 1, self._tiers) from None

    def poll(self) -> list[TransferResult]:
        """Results of jobs that ended since the last call; never blocks."""
        with self._guard:
            self._check_open()
            if self._tiers is not None:
                with deferred_interrupts():
                    self._tiers.process()
            # The common idle poll is cheap.
            if self._jobs.has_unsettled or self._engine.has_finished():
                with deferred_interrupts():
                    self._jobs.settle(self._engine.get_finished())
            return self._jobs.take_ready(None)

    def wait(self, job_ids: Iterable[int | None] | None = None) -> list[TransferResult]:
        """Blocks until the jobs end; returns their results, in the order given.

        Default: every job not yet reported. Each id must be a job not yet reported,
        listed once (None entries, as `store` may return, are skipped); otherwise
        `OffloaderError` is raised before anything is collected. Interruptible: an
        interrupt while waiting loses nothing.
        """
        with self._guard:
            self._check_open()
            ids = None if job_ids is None else self._jobs.check_wait_ids(job_ids)
            in_engine = self._jobs.in_engine(ids)
            self._engine.join(in_engine)  # blocks; may be interrupted, changes nothing
            with deferred_interrupts():
                self._jobs.settle(self._engine.wait(in_engine))
                if self._tiers is not None:
                    self._tiers.process()  # finished tier jobs release their pins
            return self._jobs.take_ready(ids)

    def reset_cache(self) -> None:
        """Forgets every stored chunk.

        Jobs in flight still end and are reported; a load among them delivers the bytes
        it was started for (the engine keeps new stores off the rows it still reads),
        a store among them is not recorded (its keys belong to the old generation).
        """
        with self._guard:
            self._check_open()
            if self._tiers is not None:
                # No tier thread may touch a row the store is about to forget (vLLM's
                # drain_jobs); interruptible, and nothing has changed until it returns.
                self._tiers.join()
            with deferred_interrupts():
                if self._tiers is not None:
                    self._tiers.process()
                self._store.reset_cache()
                if self._tiers is not None:
                    generation = self._store.cache_generation
                    self._tiers.hold_promotions(lambda: self._jobs.all_in_generation(generation))

    def close(self) -> list[TransferResult]:
        """Waits for the jobs in flight, stops the transfer threads, and returns the
        results not yet reported. Idempotent (a later call returns what an interrupted
        one could not, else []); if interrupted, call it again. After it only `caches()`
        and the queries work."""
        with self._guard:
            if self._closed:  # normally []: what an interrupted close could not return
                return self._jobs.take_ready(None)
            self._engine.join()  # blocks; may be interrupted, changes nothing
            with deferred_interrupts():
                self._jobs.settle(self._engine.get_finished())
            if self._tiers is not None:
                self._tiers.join()  # cascades reach the tiers; blocks, changes nothing
            with deferred_interrupts():
                self._engine.close()
                if self._tiers is not None:
                    self._tiers.close(own=self._own_tiers)
                self._closed = True
            return self._jobs.take_ready(None)

    def __enter__(self) -> KVOffloader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise OffloaderStateError("the offloader is closed; build a new one")

    # -- internals: jobs ----------------------------------------------------------------

    def _start_store(
        self, g: int, keys: list[OffloadKey], ids: list[list[int]], offered: list[OffloadKey]
    ) -> int | None:
        job = None
        try:
            with deferred_interrupts():
                out = self._store.prepare_store(offered)
                if out is None or not out.keys_to_store:
                    return None
                job = self._jobs.record(Direction.STORE, g, list(out.keys_to_store))
            self._engine.submit_store(job, [store_transfer(g, keys, ids, out)])
        except BaseException:  # on any exit: the caller gets no id, so no job is left
            if job is not None:
                with deferred_interrupts():
                    self._jobs.abandon(job)
            raise
        return job

    def _start_load(self, g: int, keys: list[OffloadKey], ids: list[list[int]]) -> int:
        job = None
        if self._tiers is not None:
            with deferred_interrupts():
                self._tiers.process()
        where = locate_missing(self._tiers, keys)  # tier I/O: outside the deferred block
        try:
            with deferred_interrupts():
                chunk_ids, pinned, waits = prepare_load(self._store, self._tiers, g, keys, where)
                job = self._jobs.record(Direction.LOAD, g, pinned, waits)
                for tier_job, tier_keys in waits:  # waits come from a tier path only
                    cast(TierPath, self._tiers).hold(tier_job, job, tier_keys)
            blocks = tuple(b for chunk in ids for b in chunk)
            transfer = GroupTransfer(g, blocks, tuple(chunk_ids))
            if waits:
                self._engine.submit_load(
                    job,
                    [transfer],
                    after=[j.future for j, _ in waits],
                    check=lambda: TierPath.check_loaded(waits),
                )
            else:
                self._engine.submit_load(job, [transfer])
        except BaseException:  # on any exit: the caller gets no id, so no job is left
            if job is not None:
                with deferred_interrupts():
                    self._jobs.abandon(job)
            raise
        return job

    def _tier_lookup(
        self, g: int, keys: list[OffloadKey], window: int | None, wait: bool
    ) -> tuple[int, int]:
        """`lookup` with tiers: (chunks loadable now, chunks found in the host or a
        tier). Each step that changes the store holds SIGINT; asking the tiers and
        waiting for the promotions are interruptible and change nothing."""
        tiers = self._tiers
        assert tiers is not None  # internal: called only when the offloader has tiers
        with deferred_interrupts():
            tiers.process()
        plan = tiers.plan_lookup(keys, window)  # asks the tiers: bounded calls
        with deferred_interrupts():
            promotions = tiers.promote_plan(g, plan)
        if wait:
            tiers.join(promotions)  # bounded by the tiers' timeouts
            with deferred_interrupts():
                tiers.process(promotions)
        return tiers.loadable(plan, recount=wait), plan.found
