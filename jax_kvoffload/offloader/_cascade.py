"""The secondary-tier path of `KVOffloader`: cascades, promotions, and their counters.

vLLM 0.33.0's tiering semantics (`vllm/v1/kv_offload/tiering/manager.py`), for one
process that is scheduler and worker at once:

- **Cascade** (host -> tier): when a device -> host store completes, its chunks are
  pinned once per tier without counting as an access (vLLM's `prepare_read`) and
  handed to every tier; the pins go when the tier's job ends. A tier that cannot take
  the job now drops it (its `max_pending_store_bytes`, a server down): counted, never
  waited for.
- **Promotion** (tier -> host): a tier hit gets a write-pending host chunk
  (`prepare_store`, vLLM's `prepare_write`) that the tier fills; when the tier's job
  ends the chunk becomes readable, or is freed for the keys that missed.
- **Lookups** ask the tiers in order for keys the host lacks (bounded calls).
- **Reset / close** first let every tier job end (`drain`, bounded by the tiers' own
  timeouts): no tier thread touches a host row the store has forgotten. After a reset,
  promotions wait until the transfer jobs started before it have ended (vLLM's
  `_promotions_held`): one of them may still read or write a freed row.

Everything here runs on the offloader's caller thread, under its guard; the tiers'
threads only move bytes and complete futures. Plain code: the offloader calls each
method that changes the store or the path (`process`, `cascade`, `promote_plan`,
`promote`, `hold`, `close`) inside its `deferred_interrupts` block, and the ones that
block (`plan_lookup` asks the tiers, `join` waits) outside it; those change nothing but
counters, so an interrupt in them loses nothing. `lookup`, `wait` and `drain` join and
record in one call, for callers that hold no signal (the tpu-inference connector).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import cast

from jax_kvoffload._log_once import log_once
from jax_kvoffload.errors import KVOffloadStateError, KVOffloadTypeError
from jax_kvoffload.hostmem import HostPool
from jax_kvoffload.offloader._tier_stats import TierCounts
from jax_kvoffload.store import HostStore, LookupResult, OffloadKey
from jax_kvoffload.tiers import SecondaryTier, TierBufferSizeError, TierJobResult

__all__ = ["LookupPlan", "PromotionMissError", "TierPath", "prefix_chunks"]

logger = logging.getLogger(__name__)

_DRAIN_STEP_S = 0.1  # drain in short waits: an interrupt is seen between them


class PromotionMissError(KVOffloadStateError):
    """A key a load waited for missed its promotion (the load job fails: recompute)."""


@dataclass
class LookupPlan:
    """What a lookup found (`TierPath.plan_lookup`): the host's hits, the tier holding
    each key the host lacks, the prefix counted, and the promotions its load needs."""

    keys: list[OffloadKey]
    window: int | None
    host: list[bool]  # HIT in the host now
    need: range  # the chunks a load of the counted prefix reads
    fetch: list[int]  # of those, the ones only a tier holds (to promote)
    fetch_tiers: list[int]  # the tier holding each of `fetch`
    found: int  # chunks present anywhere (`hit_tokens`)


@dataclass
class _TierJob:
    tier: int
    group: int
    keys: list[OffloadKey]
    generation: int
    future: Future[TierJobResult]
    promotion: bool
    # Promotions: the host chunk of each key, and the load jobs (offloader ids)
    # waiting for keys; each gets its keys pinned for it when the promotion is recorded.
    chunks: dict[OffloadKey, int] = field(default_factory=dict)
    holders: dict[int, list[OffloadKey]] = field(default_factory=dict)
    steps: set[str] = field(default_factory=set)  # store calls of `_finish` already made


PromotionWait = tuple[_TierJob, list[OffloadKey]]  # a load's wait: a promotion, its keys


class TierPath:
    """Cascades and promotions between a `HostStore` + `HostPool` and its tiers.

    Args:
      tiers: the tiers, in lookup order (the first holding a key serves it).
      store, pool: the host tier (the offloader's).

    A promotion that a load waits for pins its keys for that load when it has made them
    readable; `release_load` hands those keys to the load's owner when the load ends.
    """

    def __init__(self, tiers: Sequence[SecondaryTier], store: HostStore, pool: HostPool) -> None:
        self.tiers = tuple(tiers)
        self._store = store
        self._pool = pool
        self._jobs: list[_TierJob] = []
        self._pinned: dict[int, list[OffloadKey]] = {}  # load id -> keys promotions pinned for it
        self._pending: dict[OffloadKey, _TierJob] = {}  # key -> its promotion in flight
        self._held_until: Callable[[], bool] | None = None
        self._orphans: list[tuple[int, str, list[OffloadKey]]] = []  # (generation, kind, keys)
        self.counts = TierCounts([tier.medium for tier in self.tiers])

    # -- queries ------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def promotion_of(self, key: OffloadKey) -> _TierJob | None:
        """The promotion in flight for `key`, if any."""
        return self._pending.get(key)

    def host_state(self, key: OffloadKey) -> LookupResult:
        """The host's answer for `key`, without counting a lookup in the store's stats
        (the offloader's own checks are not the engine's lookups)."""
        chunk = self._store.policy.get(key)
        if chunk is None:
            return LookupResult.MISS
        return LookupResult.HIT if chunk.ref_cnt >= 0 else LookupResult.HIT_PENDING

    def promotions_held(self) -> bool:
        """Whether promotions wait for transfer jobs older than the last reset."""
        if self._held_until is not None and not self._held_until():
            return True
        self._held_until = None
        return False

    def hold_promotions(self, until: Callable[[], bool]) -> None:
        """No promotion starts before `until()` is true (after a reset)."""
        self._held_until = until

    # -- lookups --------------------------------------------------------------------------

    def locate(self, keys: Sequence[OffloadKey]) -> list[int | None]:
        """For each key, the index of the first tier holding it now, or None."""
        where: list[int | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        for t, tier in enumerate(self.tiers):
            if not todo:
                break
            try:
                found = tier.contains([keys[i] for i in todo])
            except Exception:  # a tier that cannot answer has nothing (logged)
                logger.exception("secondary tier %d: lookup failed", t)
                found = [False] * len(todo)
            self.counts.add(t, "lookups", len(todo))
            self.counts.add(t, "lookup_hits", sum(found))
            for i, hit in zip(todo, found, strict=True):
                if hit:
                    where[i] = t
            todo = [i for i, hit in zip(todo, found, strict=True) if not hit]
        return where

    def plan_lookup(self, keys: list[OffloadKey], window: int | None) -> LookupPlan:
        """Counts the longest prefix (`prefix_chunks`) present in the host, in a promotion
        in flight, or in a tier (asked now: bounded calls), and which of its chunks a
        load needs promoted. Changes nothing but lookup counts."""
        store = self._store
        state = [store.lookup(k) for k in keys]
        host = [s is LookupResult.HIT for s in state]
        promoting = [s is LookupResult.HIT_PENDING and k in self._pending for s, k in
                     zip(state, keys, strict=True)]  # fmt: skip
        tier_of: list[int | None] = [None] * len(keys)
        if not self.promotions_held():
            misses = [i for i, s in enumerate(state) if s is LookupResult.MISS]
            for i, t in zip(misses, self.locate([keys[i] for i in misses]), strict=True):
                tier_of[i] = t
        present = [h or p or t is not None for h, p, t in
                   zip(host, promoting, tier_of, strict=True)]  # fmt: skip
        n = prefix_chunks(present, window)
        need = range(0 if window is None else max(0, n - window), n)
        fetch = [(i, t) for i in need if (t := tier_of[i]) is not None]
        return LookupPlan(
            keys, window, host, need, [i for i, _ in fetch], [t for _, t in fetch], sum(present)
        )

    def promote_plan(self, group: int, plan: LookupPlan) -> list[_TierJob]:
        """Promotes the tier hits the load of the counted prefix needs (keeping its host
        hits from being evicted for them); returns the promotions it waits for."""
        keys = plan.keys
        self.promote(
            group,
            [keys[i] for i in plan.fetch],
            plan.fetch_tiers,
            protect=[keys[i] for i in plan.need if plan.host[i]],
        )
        jobs = {id(j): j for i in plan.need if (j := self._pending.get(keys[i])) is not None}
        return list(jobs.values())

    def lookup(
        self, group: int, keys: list[OffloadKey], window: int | None, wait: bool
    ) -> tuple[int, int]:
        """Chunks loadable now from the host, after promoting the tiers' hits; and the
        chunks found (in the host or a tier: `hit_tokens`). The steps in one call, for
        a caller that holds no signal (the tpu-inference connector); `KVOffloader`
        takes them one by one, each step that changes the store with SIGINT held.
        Without `wait` the host's count now: promotions finish in the background."""
        plan = self.plan_lookup(keys, window)
        promotions = self.promote_plan(group, plan)
        if wait:
            self.wait(promotions)
        return self.loadable(plan, recount=wait), plan.found

    def loadable(self, plan: LookupPlan, recount: bool) -> int:
        """Chunks loadable from the host now: as planned, or (`recount`, once the
        promotions were waited for and processed) counted again from the host."""
        host = list(plan.host)
        if recount:
            for i in plan.need:
                if not host[i]:
                    host[i] = self.host_state(plan.keys[i]) is LookupResult.HIT
        return prefix_chunks(host, plan.window)

    # -- cascades -------------------------------------------------------------------------

    def cascade(self, group: int, keys: list[OffloadKey]) -> None:
        """Hands the chunks of a completed store to every tier (pinned meanwhile)."""
        store = self._store
        for t, tier in enumerate(self.tiers):
            chunks = store.prepare_load(keys)  # vLLM's prepare_read: no access recorded
            try:
                rows = [self._pool.chunk_row(group, c) for c in chunks]
                items = list(zip(keys, rows, strict=True))
                future = tier.submit_store(items)
            except BaseException as exc:  # on any exit: no job will drop these pins
                self.counts.add(t, "cascade_failed", len(keys))
                self._orphans.append((store.cache_generation, "unpin", keys))
                self._settle_orphans()
                if not isinstance(exc, Exception):
                    raise
                logger.exception("secondary tier %d: cascade of %d keys failed", t, len(keys))
                continue
            self._jobs.append(
                _TierJob(t, group, keys, store.cache_generation, future, promotion=False)
            )
            self.counts.add(t, "cascade_jobs", 1)

    # -- promotions -----------------------------------------------------------------------

    def promote(
        self, group: int, keys: list[OffloadKey], tier_of: list[int], protect: list[OffloadKey]
    ) -> list[OffloadKey]:
        """Starts loading `keys` from their tiers into new host chunks.

        `protect`: keys the caller counts on staying in the host (offered alongside, so
        this allocation never evicts them). Returns the keys whose promotion started.
        """
        # Each key once: the store allocates a chunk per key offered, and only one of
        # two chunks under a key could ever be filled (the other stays write-pending).
        first: dict[OffloadKey, int] = {}
        for k, t in zip(keys, tier_of, strict=True):
            first.setdefault(k, t)
        keys, tier_of = list(first), list(first.values())
        if not keys:
            return []
        store = self._store
        out = store.prepare_store([*protect, *keys])
        if out is None:  # no room: these keys stay where they are
            for t in set(tier_of):
                self.counts.add(t, "promotion_no_room", sum(1 for x in tier_of if x == t))
            return []
        chunk_of = dict(zip(out.keys_to_store, out.chunk_ids, strict=True))
        unsent = dict.fromkeys(out.keys_to_store)  # allocated, not yet with a tier
        started: list[OffloadKey] = []
        try:
            for t in sorted(set(tier_of)):
                mine = [k for k, x in zip(keys, tier_of, strict=True) if x == t and k in unsent]
                if mine:
                    started += self._submit_promotion(t, group, mine, chunk_of)
                    for k in mine:
                        del unsent[k]
        finally:
            if unsent:  # on any exit: free what no tier will fill
                self._orphans.append((store.cache_generation, "free", list(unsent)))
                self._settle_orphans()
        return started

    def _submit_promotion(
        self, t: int, group: int, keys: list[OffloadKey], chunk_of: dict[OffloadKey, int]
    ) -> list[OffloadKey]:
        """Hands `keys` (write-pending chunks) to tier `t`; on failure frees them."""
        store = self._store
        try:
            items = [(k, self._pool.chunk_row_for_write(group, chunk_of[k])) for k in keys]
            future = self.tiers[t].submit_load(items)
        except Exception:
            store.complete_store(keys, success=False)
            self.counts.add(t, "promotion_failed", len(keys))
            logger.exception("secondary tier %d: promotion of %d keys failed", t, len(keys))
            return []
        job = _TierJob(t, group, keys, store.cache_generation, future, promotion=True)
        job.chunks = {k: chunk_of[k] for k in keys}
        self._jobs.append(job)
        self.counts.add(t, "promotion_jobs", 1)
        for k in keys:
            self._pending[k] = job
        return list(keys)

    def hold(self, job: _TierJob, load_id: int, keys: list[OffloadKey]) -> None:
        """Load `load_id` waits for `keys` of promotion `job` (pinned for it at the end)."""
        job.holders.setdefault(load_id, []).extend(keys)

    def release_load(self, load_id: int) -> list[OffloadKey]:
        """Load `load_id` ended: promotions still in flight no longer pin for it.
        Returns the keys they pinned for it (the caller unpins them with its own)."""
        for job in self._jobs:
            job.holders.pop(load_id, None)
        return self._pinned.pop(load_id, [])

    @staticmethod
    def check_loaded(jobs: Sequence[PromotionWait]) -> None:
        """Raises if one of the keys a load needs missed its promotion (worker thread)."""
        for job, keys in jobs:
            result = _job_result(job.future)
            ok = dict(zip(result.keys, result.ok, strict=True))
            missed = [k for k in keys if not ok.get(k)]
            if missed:
                raise PromotionMissError(
                    f"{len(missed)} chunk(s) missed in secondary tier {job.tier} on the way "
                    "to the host (evicted or found corrupt since the lookup): recompute them"
                )

    # -- completion -----------------------------------------------------------------------

    def process(self, only: Sequence[_TierJob] | None = None) -> None:
        """Records every tier job that has ended (or those of `only` that have)."""
        self._settle_orphans()
        for job in list(self._jobs if only is None else only):
            if job.future.done() and job in self._jobs:
                self._finish(job)
                self._jobs.remove(job)

    def join(self, jobs: Sequence[_TierJob] | None = None, timeout: float | None = None) -> bool:
        """Waits (interruptibly) for tier jobs (default: all) to end; False on timeout.
        Records nothing: `process` them afterwards (the offloader, SIGINT held)."""
        targets = list(self._jobs if jobs is None else jobs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            pending = [j.future for j in targets if not j.future.done()]
            if not pending:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            step = _DRAIN_STEP_S if left is None else min(left, _DRAIN_STEP_S)
            wait_futures(pending, timeout=step)
        return True

    def wait(self, jobs: Sequence[_TierJob] | None = None, timeout: float | None = None) -> bool:
        """`join`, then records the jobs that ended; False on timeout."""
        done = self.join(jobs, timeout)
        self.process(jobs)
        return done

    def drain(self) -> None:
        """Waits for every tier job and records it (reset, close): bounded by the tiers'
        own timeouts."""
        self.wait()

    def close(self, own: bool) -> None:
        """Ends the path: every job waited for and recorded (`drain`: at once after a
        `join`); the tiers closed when `own`."""
        self.drain()
        if own:
            for tier in self.tiers:
                tier.close()

    def _finish(self, job: _TierJob) -> None:
        """Records one ended tier job in the store, step by step: each store call is
        marked done when it returned, so a call interrupted before it ran is made again
        by the next `process` and none twice."""
        try:
            result = _job_result(job.future)
        except BaseException as exc:  # a tier must not raise into a job; count it
            logger.warning("secondary tier %d: job failed: %r", job.tier, exc)
            result = TierJobResult(
                "load" if job.promotion else "store", tuple(job.keys), (False,) * len(job.keys)
            )
        current = job.generation == self._store.cache_generation
        ok = dict(zip(result.keys, result.ok, strict=True))
        good = [k for k in job.keys if ok.get(k)]
        bad = [k for k in job.keys if not ok.get(k)]
        if "counted" not in job.steps:
            self.counts.job_ended(job.tier, job.promotion, result, len(good), len(bad))
            job.steps.add("counted")
        if not job.promotion:
            if current and "unpinned" not in job.steps:
                self._store.complete_load(job.keys)  # the cascade's pins
                job.steps.add("unpinned")
            return
        for k in job.keys:
            if self._pending.get(k) is job:
                del self._pending[k]
        if not current:
            return  # a reset forgot these chunks (and the loads' pins with them)
        if bad and "freed" not in job.steps:
            self._store.complete_store(bad, success=False)
            job.steps.add("freed")
        if good and "stored" not in job.steps:
            self._store.complete_store(good, success=True)
            job.steps.add("stored")
        for load_id, keys in list(job.holders.items()):
            mine = [k for k in keys if ok.get(k)]
            if mine:
                self._store.prepare_load(mine)
                self._pinned.setdefault(load_id, []).extend(mine)
            del job.holders[load_id]

    def _settle_orphans(self) -> None:
        """Store calls an interrupt kept from running (a job that never reached its
        tier): unpins and frees, made now, unless a reset forgot the chunks since."""
        while self._orphans:
            generation, kind, keys = self._orphans[0]
            if generation == self._store.cache_generation:
                if kind == "unpin":
                    self._store.complete_load(keys)
                else:
                    self._store.complete_store(keys, success=False)
            self._orphans.pop(0)


def prefix_chunks(present: Sequence[bool], window: int | None) -> int:
    """The longest loadable prefix, in chunks: every chunk of it present (full
    attention), or its last `window` chunks (a sliding window of that many chunks)."""
    if window is None:
        return next((i for i, hit in enumerate(present) if not hit), len(present))
    for end in range(len(present), 0, -1):
        if all(present[max(0, end - window) : end]):
            return end
    return 0


def _job_result(future: Future[TierJobResult]) -> TierJobResult:
    """A tier job's result; a buffer of the wrong length (another geometry's entry under
    a key of ours) is logged once and its keys are misses, the others as they ended."""
    try:
        result = future.result()
    except TierBufferSizeError as e:
        # Debug after the first: it recurs for every such key and says nothing new.
        log_once(logger, "tier-size", "secondary tier: %s; such keys are misses", e)
        return cast(TierJobResult, e.result)  # set before the future raises
    if not isinstance(result, TierJobResult):  # a third-party tier's bug: its keys fail
        raise KVOffloadTypeError(
            f"a secondary tier's job future returned {type(result).__name__}, not a "
            "TierJobResult; its store and load jobs must each resolve to one"
        )
    return result
