"""ARC eviction (vLLM 0.33.0 ``ARCCachePolicy``, ``cpu/policies/arc.py``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import final

from ._context import AbstractRequestContext as RequestContext
from ._keys import OffloadKey
from ._policy_base import (
    AbstractEvictionPolicy,
    BatchHooks,
    ChunkStatus,
    order_request_keys,
    override,
)

__all__ = ["ARCPolicy"]


@final
class ARCPolicy(AbstractEvictionPolicy, BatchHooks):
    """Adaptive Replacement Cache over chunks.

    ``t1`` holds chunks used once (inserted, not yet reused), ``t2`` chunks reused at
    least once; both are ordered LRU first. ``b1`` and ``b2`` remember keys recently
    evicted from ``t1`` and ``t2`` (ghosts, at most ``cache_capacity`` each).
    ``target_t1_size`` (starts at 0) is the share of the cache ARC wants for ``t1``:
    a miss on a ``b1`` ghost raises it by ``max(1, |b2| / |b1|)`` (recency matters), a
    miss on a ``b2`` ghost lowers it by ``max(1, |b1| / |b2|)`` (frequency matters).

    * ``insert``: to the MRU end of ``t1``; the key leaves the ghost lists.
    * ``touch`` (reverse key order): a ready ``t1`` chunk moves to the MRU end of
      ``t2``; a write-pending one stays in ``t1`` at its MRU end (being stored is not
      a second use); a ``t2`` chunk moves to its MRU end; an absent key adapts the
      target if it is a ghost.
    * ``on_store_miss``: only the ghost adaptation (once per request and key; the
      manager deduplicates).
    * ``on_request_finished``: keys the request only inserted move to the MRU end of
      their list; keys it reused move ``t1`` -> ``t2`` (or to the MRU end of ``t2``).
    * ``evict``: per victim, while the virtual ``|t1|`` is at least
      ``int(target_t1_size)`` take the LRU-most idle unprotected ``t1`` chunk, else
      the one of ``t2``, else ``t1`` again; all or nothing.
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.target_t1_size: float = 0.0
        self.t1: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()
        # Every key of t1 and t2, so that `get` (the manager's hottest call) is one
        # C-level dict lookup instead of a Python method probing two lists.
        self._index: dict[OffloadKey, ChunkStatus] = {}
        self.get = self._index.get  # type: ignore[method-assign, assignment]

    def _adapt_to_ghost_hit(self, key: OffloadKey) -> None:
        if key in self.b1:
            delta = max(1, len(self.b2) / len(self.b1))
            self.target_t1_size = min(self.target_t1_size + delta, self.cache_capacity)
            self.b1.move_to_end(key)
        elif key in self.b2:
            delta = max(1, len(self.b1) / len(self.b2))
            self.target_t1_size = max(self.target_t1_size - delta, 0)
            self.b2.move_to_end(key)

    @override
    def get(self, key: OffloadKey) -> ChunkStatus | None:  # replaced per instance
        return self._index.get(key)

    @override
    def insert(self, key: OffloadKey, chunk: ChunkStatus, ctx: RequestContext | None) -> None:
        self.t1[key] = chunk
        self._index[key] = chunk
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    @override
    def insert_many(
        self,
        keys: Sequence[OffloadKey],
        chunks: Sequence[ChunkStatus],
        ctx: RequestContext | None,
    ) -> None:
        t1, index, b1, b2 = self.t1, self._index, self.b1, self.b2
        for key, chunk in zip(keys, chunks, strict=True):
            t1[key] = chunk
            index[key] = chunk
            b1.pop(key, None)
            b2.pop(key, None)

    @override
    def mark_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        return  # ARC reads ref counts when it evicts; nothing to track

    @override
    def mark_non_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        return

    @override
    def remove(self, key: OffloadKey) -> None:
        self._index.pop(key, None)
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    @override
    def touch(self, keys: Sequence[OffloadKey], ctx: RequestContext | None) -> None:
        t1, t2 = self.t1, self.t2
        for key in reversed(keys):
            chunk = t1.pop(key, None)
            if chunk is not None:
                if chunk.ref_cnt >= 0:
                    t2[key] = chunk
                else:
                    t1[key] = chunk
            elif key in t2:
                t2.move_to_end(key)
            elif key in self.b1 or key in self.b2:
                self._adapt_to_ghost_hit(key)

    @override
    def on_store_miss(self, keys: Sequence[OffloadKey], ctx: RequestContext | None) -> None:
        b1, b2 = self.b1, self.b2
        for key in reversed(keys):
            if key in b1 or key in b2:  # most misses are no ghost: skip the call
                self._adapt_to_ghost_hit(key)

    @override
    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        ctx: RequestContext,
    ) -> None:
        t1, t2 = self.t1, self.t2
        for key in reversed(order_request_keys(key_groups, ctx)):
            if key in insertion_only_keys:
                # A store is not a reuse: restore tail-to-head recency in place.
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)
            elif key in reused_keys:
                chunk = t1.pop(key, None)
                if chunk is not None:
                    t2[key] = chunk
                elif key in t2:
                    t2.move_to_end(key)

    @override
    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        if n <= 0:
            return []
        # Select first (no mutation) so a failure leaves the policy untouched. The
        # scans only move forward: restarting from the LRU end per victim would make
        # a batch eviction quadratic.
        t1_iter = iter(self.t1.items())
        t2_iter = iter(self.t2.items())

        def next_idle(
            entries: Iterator[tuple[OffloadKey, ChunkStatus]],
        ) -> tuple[OffloadKey, ChunkStatus] | None:
            for key, chunk in entries:
                if chunk.ref_cnt == 0 and key not in protected:
                    return key, chunk
            return None

        target = int(self.target_t1_size)
        virtual_t1_size = len(self.t1)
        from_t1: list[tuple[OffloadKey, ChunkStatus]] = []
        victims: list[tuple[OffloadKey, ChunkStatus]] = []
        for _ in range(n):
            entry = None
            if virtual_t1_size >= target:
                entry = next_idle(t1_iter)
                if entry is not None:
                    from_t1.append(entry)
                    virtual_t1_size -= 1
            if entry is None:
                entry = next_idle(t2_iter)
            if entry is None:
                entry = next_idle(t1_iter)
                if entry is None:
                    return None
                from_t1.append(entry)
                virtual_t1_size -= 1
            victims.append(entry)

        t1_keys = {key for key, _ in from_t1}
        for key, _ in victims:
            del self._index[key]
            if key in t1_keys:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        for ghost in (self.b1, self.b2):
            for _ in range(len(ghost) - self.cache_capacity):
                ghost.popitem(last=False)
        return victims

    @override
    def clear(self) -> None:
        self._index.clear()
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.target_t1_size = 0.0
