"""The scheduler-side host store (vLLM ``CPUOffloadingManager``, ``cpu/manager.py``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar, final

from jax_kvoffload.config.internals import checked_arguments

from ._access import RequestAccess, access_state, finished_key_groups
from ._capacity import HOST_PAGE_SIZE, cpu_tier_capacity
from ._checks import check_int, need_context, not_bytes
from ._context import AbstractRequestContext, LookupResult, check_context
from ._errors import PolicyContractError, StoreTypeError
from ._keys import OffloadKey, check_keys
from ._loads import LoadPath
from ._policy_base import AbstractEvictionPolicy, BatchHooks, ChunkStatus
from ._registry import get_policy_class
from ._reporting import StoreReporting
from ._state import StoreState
from ._stats import StoreCounters, StoreStats
from ._tracker import ReuseTracker

__all__ = ["HostStore", "PrepareStoreOutput"]

logger = logging.getLogger(__name__)

_MISS, _HIT, _HIT_PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING
_R = TypeVar("_R")
_E = TypeVar("_E")


class PrepareStoreOutput(NamedTuple):
    """What ``prepare_store`` allocated (an immutable named tuple).

    Attributes:
      keys_to_store: Offered keys that were absent, in offer order (duplicates kept).
      chunk_ids: The host chunk of each key of ``keys_to_store``: fresh ids in
        ascending order first, then freed ids, most recently freed first.
      evicted_keys: Keys evicted to make room, in eviction order.
    """

    keys_to_store: tuple[OffloadKey, ...]
    chunk_ids: tuple[int, ...]
    evicted_keys: tuple[OffloadKey, ...]


_EMPTY_OUTPUT = PrepareStoreOutput((), (), ())
_new_output = tuple.__new__


@final
@checked_arguments
class HostStore:
    """Bookkeeping of the host chunk pool: what is stored where, pins, eviction, events.

    The store holds no KV bytes; the transfer engine moves bytes into and out of the
    chunk ids it hands out. Call protocol (one scheduler thread; not thread-safe):

    * ``lookup(key)``: MISS, HIT (readable) or HIT_PENDING (store in flight).
    * Load: ``prepare_load(keys)`` pins each key (all present and ready) and returns
      their chunk ids; after the transfer, ``complete_load(keys)`` unpins. Pins nest.
    * Store: ``prepare_store(keys)`` allocates chunks for the absent keys (evicting
      idle, unprotected chunks) and marks them write-pending; after the transfer,
      ``complete_store(keys, success)`` makes them readable, or frees them on failure.
    * Pinned and write-pending chunks are never evicted; no key of an offer is
      evicted by that offer. Call ``lookup`` and the ``prepare_load`` that pins its
      hits without an intervening ``prepare_store``.
    * ``reset_cache()`` forgets everything at once; the caller must not complete jobs
      prepared before it (vLLM's scheduler fences them by job id).

    Args:
      num_chunks: Chunks in the host pool (see ``cpu_tier_capacity``), >= 0.
      eviction_policy: A registered policy name, "lru" (default) or "arc".
      cache_policy_module_path: Module to import an unregistered policy class from.
      enable_events: Record events for ``take_events`` (vLLM's default: off).
      store_threshold: >= 2 stores a key only once it was offered that many times.
      max_tracker_size: Keys the reuse tracker counts at most (threshold >= 2 only).

    The store owns its parts: the eviction policy, a `LoadPath` (pins for reads), a
    `StoreReporting` (events, counters, stats) and the `StoreState` they share.
    """

    def __init__(
        self,
        num_chunks: int,
        *,
        eviction_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
    ) -> None:
        num_chunks = check_int("num_chunks", num_chunks, 0)
        self._store_threshold = check_int("store_threshold", store_threshold, 0)
        check_int("max_tracker_size", max_tracker_size, 0)
        if not isinstance(enable_events, bool):
            raise StoreTypeError(
                f"enable_events must be a bool, got {type(enable_events).__name__}: "
                f"{enable_events!r}."
            )
        policy_cls = get_policy_class(eviction_policy, cache_policy_module_path)
        # By keyword, as vLLM builds policies (`policy_cls(cache_capacity=num_chunks)`).
        self._policy: AbstractEvictionPolicy = policy_cls(cache_capacity=num_chunks)
        self._get = self._policy.get
        # The built-in policies take batches; any other policy gets vLLM's per-key
        # hook calls in vLLM's order (a custom policy sees what it would under vLLM).
        self._batched = isinstance(self._policy, BatchHooks)
        self._store_misses = not self._batched or self._policy.observes_store_misses  # type: ignore[attr-defined]
        self._counters = StoreCounters()
        # Events are (keys, removed, metadata_only) tuples, built into objects when taken.
        self._state = StoreState(num_chunks, events=[] if enable_events else None)
        self._tracker = ReuseTracker(max_tracker_size) if store_threshold >= 2 else None
        self._loads = LoadPath(self._policy, self._batched, self._state)
        self._reporting = StoreReporting(
            self._get, self._counters, self._state, counts_skips=self._tracker is not None
        )
        self.lookup = self.lookup_function(_MISS, _HIT, _HIT_PENDING)  # type: ignore[method-assign]

    @classmethod
    @checked_arguments
    def from_cpu_budget(
        cls,
        cpu_bytes_to_use: int | str | None,
        *,
        worker_kv_bytes_per_block: int,
        blocks_per_chunk: int,
        world_size: int = 1,
        replicated_layout: bool = False,
        page_size: int = HOST_PAGE_SIZE,
        **kwargs: object,
    ) -> HostStore:
        """Builds a store sized by ``cpu_tier_capacity`` (the remaining kwargs pass on)."""
        capacity = cpu_tier_capacity(
            cpu_bytes_to_use,
            worker_kv_bytes_per_block=worker_kv_bytes_per_block,
            blocks_per_chunk=blocks_per_chunk,
            world_size=world_size,
            replicated_layout=replicated_layout,
            page_size=page_size,
        )
        return cls(capacity.num_chunks, **kwargs)  # type: ignore[arg-type]

    # --- introspection ---

    @property
    def num_chunks(self) -> int:
        return self._state.num_chunks

    @property
    def policy(self) -> AbstractEvictionPolicy:
        """The eviction policy (read it; mutating it breaks the store's counters)."""
        return self._policy

    @property
    def num_free_chunks(self) -> int:
        state = self._state
        return len(state.free_list) + state.num_chunks - state.num_allocated

    @property
    def num_occupied_chunks(self) -> int:
        """Chunks holding a key (ready, pinned or write-pending)."""
        return self._state.num_allocated - len(self._state.free_list)

    @property
    def num_evictable_chunks(self) -> int:
        return self._state.num_evictable

    @property
    def num_write_pending_chunks(self) -> int:
        return self._state.num_write_pending

    @property
    def cache_generation(self) -> int:
        """Bumped by ``reset_cache``; lets a caller fence jobs prepared before it."""
        return self._state.generation

    # --- requests ---

    def on_new_request(self, ctx: AbstractRequestContext) -> None:
        """Starts the request-scoped bookkeeping of ``ctx`` (optional)."""
        need_context("on_new_request", ctx)
        access_state(ctx, self._state, self._state.generation)

    def on_request_finished(self, ctx: AbstractRequestContext) -> None:
        """Applies the request's accesses to the policy, once per request and reset."""
        need_context("on_request_finished", ctx)
        state = ctx.get_state(RequestAccess)
        if (
            state is None
            or state.owner is not self._state
            or state.generation != self._state.generation
            or state.finished
        ):
            return
        state.finished = True
        self._policy.on_request_finished(
            finished_key_groups(state, ctx),
            state.inserted_keys - state.reused_keys,
            state.reused_keys,
            ctx,
        )

    # --- lookups and loads ---

    def lookup(self, key: OffloadKey, ctx: AbstractRequestContext | None = None) -> LookupResult:
        """Returns whether ``key`` is absent, readable, or still being stored.

        (Each store replaces this method by ``lookup_function(...)``'s closure.)
        """
        return self.lookup_function(_MISS, _HIT, _HIT_PENDING)(key, ctx)

    def lookup_function(self, miss: _R, hit: _R, hit_pending: _R) -> Callable[..., _R]:
        """Returns ``lookup`` answering with the given values instead of ours.

        The scheduler calls ``lookup`` for every chunk of every request; the closure
        is one Python frame (the vLLM bridge answers vLLM's enum members with it).
        """
        get, counters = self._get, self._counters

        def lookup(key: OffloadKey, ctx: object = None) -> _R:
            try:
                chunk = get(key)
            except TypeError:  # unhashable: not a key
                raise not_bytes(key) from None
            if chunk is None:
                # Present keys were checked when stored; only a miss needs the test.
                if type(key) is not bytes and not isinstance(key, bytes):
                    raise not_bytes(key)
                counters.lookup_misses += 1
                return miss
            if chunk.ref_cnt >= 0:
                counters.lookup_hits += 1
                return hit
            counters.lookup_hits_pending += 1
            return hit_pending

        return lookup

    def touch(self, keys: Sequence[OffloadKey], ctx: AbstractRequestContext | None = None) -> None:
        """Marks ``keys`` recently used (the first key ends most recent)."""
        keys = check_keys(keys)
        check_context(ctx)
        self._policy.touch(keys, ctx)

    # Loads (LoadPath, _loads.py). Delegating methods, not the part's bound methods
    # stored on the instance (as `lookup` is): a patch of HostStore's method must see
    # every call (tests/faults interrupt each one); a call costs one frame more (~0.1 us).

    def prepare_load(
        self, keys: Sequence[OffloadKey], ctx: AbstractRequestContext | None = None
    ) -> tuple[int, ...]:
        """Pins ``keys`` for reading and returns their chunk ids, in key order; all or
        nothing (``LoadPath.prepare_load`` lists the errors)."""
        return self._loads.prepare_load(keys, ctx)

    def complete_load(
        self, keys: Sequence[OffloadKey], ctx: AbstractRequestContext | None = None
    ) -> None:
        """Unpins ``keys`` after their load finished; all or nothing
        (``LoadPath.complete_load``)."""
        self._loads.complete_load(keys, ctx)

    # --- stores ---

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: AbstractRequestContext | None = None
    ) -> PrepareStoreOutput | None:
        """Allocates write-pending chunks for the absent keys of one offer.

        Present keys are left alone (ready ones count as reused by the request). If
        the free chunks do not suffice, idle chunks are evicted; keys of this offer
        are never evicted by it. Duplicate absent keys are not deduplicated: each gets
        a chunk (vLLM 0.33.0 does the same; the first chunk is unreachable until
        ``reset_cache``).

        Returns:
          The keys to store, their chunk ids and the evicted keys; an empty output if
          nothing needs storing; None if the chunks cannot be allocated (nothing
          changes then, beyond the policy's and tracker's observation of the offer).

        Raises:
          RequestFinishedError: if ``ctx`` finished and a key to record is new to it
            (raised where vLLM asserts: after the tracker and the policy's
            ``on_store_miss`` saw the offer, before anything is allocated).
        """
        keys = check_keys(keys)
        check_context(ctx)
        st = self._state
        tracker = self._tracker
        if tracker is not None:
            tracker.record_offer(keys)
        get = self._get
        candidates: list[OffloadKey] = []
        ready_existing: list[OffloadKey] = []
        for key in keys:
            chunk = get(key)
            if chunk is None:
                candidates.append(key)
            elif chunk.ref_cnt >= 0:
                ready_existing.append(key)
            # A write-pending key belongs to an in-flight store: neither stored nor reused.
        if tracker is not None:
            threshold = self._store_threshold
            counts = tracker.counts
            kept = [key for key in candidates if counts.get(key, 0) >= threshold]
            st.stores_skipped += len(candidates) - len(kept)
            candidates = kept
        policy = self._policy
        state = None
        if ctx is None:
            if candidates and self._store_misses:
                policy.on_store_miss(candidates, None)
        else:
            state = access_state(ctx, st, st.generation)
            if self._store_misses:
                # ARC learns from ghost hits once per request, before insert drops
                # the ghost.
                seen_misses = state.store_miss_keys
                new_misses = [key for key in candidates if key not in seen_misses]
                if new_misses:
                    policy.on_store_miss(new_misses, ctx)
                    seen_misses.update(new_misses)
            if ready_existing or len(candidates) != len(keys):
                recorded = set(candidates)
                recorded.update(ready_existing)
                offered = [key for key in keys if key in recorded]
            else:
                offered = candidates
            state.check_open(offered, ctx)
            # Candidates count as inserted only once allocated (below), as in vLLM.
            state.record(offered, policy, ctx)
            if ready_existing:
                state.record_reused(ready_existing)
        if not candidates:
            return _EMPTY_OUTPUT

        num_new = len(candidates)
        st.allocation_sizes.append(num_new)
        free_list = st.free_list
        num_fresh = st.num_chunks - st.num_allocated
        num_to_evict = num_new - len(free_list) - num_fresh
        evicted: tuple[OffloadKey, ...] = ()
        if num_to_evict > 0:
            victims = None
            if num_to_evict <= st.num_evictable:
                victims = policy.evict(num_to_evict, set(keys))
            if victims is None:
                self._counters.allocation_failures += 1
                logger.debug(
                    "prepare_store: %d chunks needed, %d free, %d evictable: cannot allocate",
                    num_new,
                    num_new - num_to_evict,
                    st.num_evictable,
                )
                return None
            if len(victims) != num_to_evict:
                raise PolicyContractError(
                    f"{type(policy).__name__}.evict({num_to_evict}, ...) returned "
                    f"{len(victims)} chunks; a policy returns exactly n or None."
                )
            st.num_evictable -= num_to_evict
            self._counters.evictions += num_to_evict
            evicted = tuple([key for key, _ in victims])
            free_list += [chunk.chunk_id for _, chunk in victims]
            if st.events is not None:
                st.events.append((evicted, True, False))

        # Fresh ids (ascending) before reused ones (LIFO), as vLLM allocates.
        start = st.num_allocated
        num_fresh = min(num_new, num_fresh)
        chunk_ids = list(range(start, start + num_fresh))
        st.num_allocated = start + num_fresh
        num_reused = num_new - num_fresh
        if num_reused:  # LIFO: the most recently freed first
            chunk_ids += reversed(free_list[-num_reused:])
            del free_list[-num_reused:]
        if self._batched:
            chunks = [ChunkStatus(chunk_id) for chunk_id in chunk_ids]
            policy.insert_many(candidates, chunks, ctx)  # type: ignore[attr-defined]
        else:
            insert = policy.insert
            for key, chunk_id in zip(candidates, chunk_ids, strict=True):
                insert(key, ChunkStatus(chunk_id), ctx)
        st.num_write_pending += num_new
        if state is not None:
            state.inserted_keys.update(candidates)
        # tuple.__new__ skips the named tuple's Python-level __new__ (a hot path).
        return _new_output(PrepareStoreOutput, (tuple(candidates), tuple(chunk_ids), evicted))

    def complete_store(
        self,
        keys: Sequence[OffloadKey],
        success: bool = True,
        ctx: AbstractRequestContext | None = None,
    ) -> None:
        """Finishes the stores of ``keys``: readable on success, freed on failure.

        Only write-pending keys change; ready or absent keys are ignored. A failure
        records a metadata-only removal event (no store event was ever emitted).
        """
        keys = check_keys(keys)
        check_context(ctx)
        if success is not True and success is not False:
            raise StoreTypeError(
                f"success must be a bool, got {type(success).__name__}: {success!r}; pass "
                "whether the transfer job succeeded."
            )
        st = self._state
        get = self._get
        done: list[OffloadKey] = []
        if success and self._batched:
            for key in keys:
                chunk = get(key)
                if chunk is not None and chunk.ref_cnt < 0:
                    chunk.ref_cnt = 0
                    done.append(key)
            if done:
                self._policy.mark_evictable_many(done)  # type: ignore[attr-defined]
            st.num_evictable += len(done)
            self._counters.stores_completed += len(done)
        elif success:
            mark_evictable = self._policy.mark_evictable
            for key in keys:
                chunk = get(key)
                if chunk is not None and chunk.ref_cnt < 0:
                    chunk.ref_cnt = 0
                    mark_evictable(key)
                    done.append(key)
            st.num_evictable += len(done)
            self._counters.stores_completed += len(done)
        else:
            remove = self._policy.remove
            for key in keys:
                chunk = get(key)
                if chunk is not None and chunk.ref_cnt < 0:
                    remove(key)
                    st.free_list.append(chunk.chunk_id)
                    done.append(key)
            self._counters.stores_failed += len(done)
        st.num_write_pending -= len(done)
        if done and st.events is not None:
            st.events.append((tuple(done), not success, not success))

    # --- reset ---

    def reset_cache(self) -> None:
        """Forgets every chunk, pinned and write-pending ones included.

        Events already recorded stay; the reuse tracker keeps its counts (as in vLLM);
        the cumulative counters keep counting. Request contexts from before the reset
        start afresh.
        """
        self._policy.clear()
        st = self._state
        st.generation += 1
        st.num_evictable = 0
        st.num_write_pending = 0
        st.free_list.clear()
        st.num_allocated = 0
        logger.debug("host store reset (generation %d)", st.generation)

    # --- events, counters and stats (StoreReporting, _reporting.py) ---

    def take_events(
        self, make_event: Callable[[tuple[OffloadKey, ...], bool, bool], _E] | None = None
    ) -> list[_E]:
        """Returns and clears the recorded events, oldest first; ``make_event(keys,
        removed, metadata_only)`` builds each (default ``OffloadingEvent``).
        See ``StoreReporting.take_events``."""
        return self._reporting.take_events(make_event)

    def counters(self) -> StoreCounters:
        """Returns the cumulative counters (since construction; never drained)."""
        return self._reporting.counters()

    def get_stats(self) -> StoreStats:
        """Returns the usage gauges and counters, and drains the per-interval values."""
        return self._reporting.get_stats()
