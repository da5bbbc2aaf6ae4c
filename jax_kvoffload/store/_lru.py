"""LRU eviction with request-aware ranks (vLLM 0.33.0 ``LRUCachePolicy``, spec 6.4)."""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Sequence
from typing import final

from ._context import AbstractRequestContext as RequestContext
from ._keys import OffloadKey
from ._policy_base import AbstractEvictionPolicy, ChunkStatus, order_request_keys, override

__all__ = ["LRUPolicy"]

# (rank, key). A rank is (global or request rank, -end position); smaller = older.
_Rank = tuple[int, int]
_Entry = tuple[_Rank, OffloadKey]

# vLLM's heap-maintenance thresholds: below 64 entries rebuilding never pays off.
_MIN_HEAP_WORK = 64


@dataclasses.dataclass(slots=True)
class _RequestRank:
    owner: object
    generation: int
    rank: int


@final
class LRUPolicy(AbstractEvictionPolicy):
    """Least recently used, with recency decoupled from pinning.

    Every chunk has a rank; the evictable chunk with the smallest rank goes first.
    A fresh global rank ``(next, 0)`` is taken on insert (when the request recorded no
    position for the key) and on ``touch``, which ranks its keys in reverse list order
    so that the first key ends most recent. A request takes one rank ``r`` at its first
    access and ranks its positioned keys ``(r, -end_position)``: while it runs, its
    tail chunks are older than its head. When it finishes, its keys are re-ranked in
    reverse prefix order (the head ends most recent).

    Evictable chunks sit in a lazily invalidated min-heap, so the rank of a pinned
    chunk can change cheaply; a chunk re-enters the heap with its current rank when
    it becomes evictable.
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._chunks: dict[OffloadKey, ChunkStatus] = {}
        self.get = self._chunks.get  # type: ignore[method-assign]  # C-level hot path
        self._ranks: dict[OffloadKey, _Rank] = {}
        self._evictable: set[OffloadKey] = set()
        self._heap: list[_Entry] = []
        self._next_rank = 0
        self._generation = 0

    # --- ranks and heap ---

    def _request_rank(self, ctx: RequestContext) -> int:
        state = ctx.get_state(_RequestRank)
        if state is None or state.owner is not self or state.generation != self._generation:
            self._next_rank += 1
            state = _RequestRank(self, self._generation, self._next_rank)
            ctx.set_state(state)
        return state.rank

    def _maybe_compact_heap(self) -> None:
        if len(self._heap) >= max(_MIN_HEAP_WORK, 2 * len(self._evictable)):
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        ranks = self._ranks
        self._heap = [(ranks[key], key) for key in self._evictable]
        heapq.heapify(self._heap)

    def _update_heap(self, updated: Sequence[OffloadKey]) -> None:
        if not updated:
            return
        # A linear rebuild beats k pushes once k is a sizeable share of the heap.
        if len(updated) >= max(_MIN_HEAP_WORK, len(self._evictable) // 4):
            self._rebuild_heap()
            return
        ranks, heap = self._ranks, self._heap
        for key in updated:
            heapq.heappush(heap, (ranks[key], key))
        self._maybe_compact_heap()

    def _refresh(self, keys: Iterable[OffloadKey]) -> None:
        chunks, ranks, evictable = self._chunks, self._ranks, self._evictable
        updated = []
        next_rank = self._next_rank
        for key in keys:
            if key in chunks:
                next_rank += 1
                ranks[key] = (next_rank, 0)
                if key in evictable:
                    updated.append(key)
        self._next_rank = next_rank
        self._update_heap(updated)

    def rank(self, key: OffloadKey) -> _Rank | None:
        """Returns the current rank of ``key`` (smaller is evicted first), or None."""
        return self._ranks.get(key)

    # --- policy interface ---

    @override
    def get(self, key: OffloadKey) -> ChunkStatus | None:  # replaced per instance
        return self._chunks.get(key)

    @override
    def insert(self, key: OffloadKey, chunk: ChunkStatus, ctx: RequestContext | None) -> None:
        position = None if ctx is None else ctx.get_offload_key_position(key)
        if position is None:
            self._next_rank += 1
            rank: _Rank = (self._next_rank, 0)
        else:
            rank = (self._request_rank(ctx), -position)  # type: ignore[arg-type]
        self._chunks[key] = chunk
        self._ranks[key] = rank
        if chunk.ref_cnt == 0:
            self._evictable.add(key)
            heapq.heappush(self._heap, (rank, key))

    @override
    def remove(self, key: OffloadKey) -> None:
        del self._chunks[key]
        self._ranks.pop(key, None)
        self._evictable.discard(key)

    @override
    def touch(self, keys: Sequence[OffloadKey], ctx: RequestContext | None) -> None:
        self._refresh(reversed(keys))

    @override
    def on_request_access(self, keys: Sequence[OffloadKey], ctx: RequestContext) -> None:
        request_rank = self._request_rank(ctx)
        chunks, ranks, evictable = self._chunks, self._ranks, self._evictable
        updated = []
        for key in keys:
            position = ctx.get_offload_key_position(key)
            if position is None or key not in chunks:
                continue
            rank = (request_rank, -position)
            # Reuse only ever makes a chunk more recent; a later touch wins.
            if ranks[key] >= rank:
                continue
            ranks[key] = rank
            if key in evictable:
                updated.append(key)
        self._update_heap(updated)

    @override
    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        ctx: RequestContext,
    ) -> None:
        del insertion_only_keys, reused_keys
        self._refresh(reversed(order_request_keys(key_groups, ctx)))

    @override
    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n <= 0:
            return []
        heap, ranks, evictable = self._heap, self._ranks, self._evictable
        selected: list[_Entry] = []
        selected_keys: set[OffloadKey] = set()
        deferred: list[_Entry] = []
        while heap and len(selected) < n:
            entry = heapq.heappop(heap)
            rank, key = entry
            if key not in evictable or ranks.get(key) != rank:
                continue  # stale: re-ranked, pinned or removed since it was pushed
            if key in selected_keys:
                continue  # an equivalent entry left by pin/unpin without re-ranking
            if key in protected:
                deferred.append(entry)
                continue
            selected.append(entry)
            selected_keys.add(key)
        for entry in deferred:
            heapq.heappush(heap, entry)
        if len(selected) < n:
            for entry in selected:
                heapq.heappush(heap, entry)
            return None
        chunks = self._chunks
        victims = []
        for _, key in selected:
            evictable.remove(key)
            del ranks[key]
            victims.append((key, chunks.pop(key)))
        self._maybe_compact_heap()
        return victims

    @override
    def clear(self) -> None:
        self._chunks.clear()
        self._ranks.clear()
        self._evictable.clear()
        self._heap.clear()
        self._next_rank = 0
        self._generation += 1

    @override
    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)
        heapq.heappush(self._heap, (self._ranks[key], key))
        self._maybe_compact_heap()

    @override
    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.remove(key)
