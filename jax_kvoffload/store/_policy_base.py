"""The eviction-policy contract and the per-chunk status it manages."""

from __future__ import annotations

import abc
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from ._context import AbstractRequestContext as RequestContext
from ._keys import OffloadKey

if sys.version_info >= (3, 12):
    from typing import override
else:  # pragma: no cover - Python < 3.12
    _F = TypeVar("_F", bound=Callable[..., object])

    def override(method: _F) -> _F:
        """Marks a method as overriding its base (``typing.override`` before 3.12)."""
        return method


__all__ = [
    "AbstractEvictionPolicy",
    "BatchHooks",
    "ChunkStatus",
    "RequestKeyGroups",
    "order_request_keys",
    "override",
]


class ChunkStatus:
    """The state of one host chunk (vLLM ``ChunkStatus``).

    Attributes:
      ref_cnt: -1 while the chunk's store is in flight (not readable), 0 when idle
        (evictable), n > 0 while n loads read it (pinned).
      chunk_id: Index of the chunk's slot in the host pool, in [0, num_chunks).
    """

    __slots__ = ("chunk_id", "ref_cnt")

    def __init__(self, chunk_id: int) -> None:
        self.ref_cnt = -1
        self.chunk_id = chunk_id

    @property
    def is_ready(self) -> bool:
        """Whether the chunk's store completed, so it may be read."""
        return self.ref_cnt >= 0

    def __repr__(self) -> str:
        return f"ChunkStatus(chunk_id={self.chunk_id}, ref_cnt={self.ref_cnt})"


class RequestKeyGroups(tuple[tuple[OffloadKey, ...], ...]):
    """The ``key_groups`` the store passes to ``on_request_finished``: a plain tuple of
    per-group tuples that also carries ``head_to_tail``, what ``order_request_keys``
    returns for it (computed while the store read the same positions)."""

    head_to_tail: list[OffloadKey]


def order_request_keys(
    key_groups: Sequence[Sequence[OffloadKey]], ctx: RequestContext
) -> list[OffloadKey]:
    """Returns one head-to-tail order of a request's keys across its groups.

    Keys are sorted by their recorded end positions when every key has one; otherwise
    the groups are concatenated in order (vLLM ``order_request_keys``).
    """
    if type(key_groups) is RequestKeyGroups:
        return list(key_groups.head_to_tail)
    keys = [key for group in key_groups for key in group]
    positions = {}
    position_of = ctx.get_offload_key_position
    for key in keys:
        position = position_of(key)
        if position is None:
            return keys
        positions[key] = position
    keys.sort(key=positions.__getitem__)
    return keys


class BatchHooks:
    """Batch forms of per-key hooks, implemented by the built-in policies only.

    The store calls these instead of a loop of per-key hooks for policies that derive
    from this class (LRU and ARC, whose per-key hooks do the same work one key at a
    time). Every other policy gets vLLM's per-key calls, in vLLM's order.
    """

    # False where `on_store_miss` never changes anything (LRU: it touches keys that
    # are absent), so the store skips the call and its once-per-request bookkeeping.
    observes_store_misses: bool = True

    def insert_many(
        self,
        keys: Sequence[OffloadKey],
        chunks: Sequence[ChunkStatus],
        ctx: RequestContext | None,
    ) -> None:
        """``insert`` for each pair, in order."""
        raise NotImplementedError

    def mark_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        """``mark_evictable`` for each key, in order."""
        raise NotImplementedError

    def mark_non_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        """``mark_non_evictable`` for each key, in order."""
        raise NotImplementedError


class AbstractEvictionPolicy(abc.ABC):
    """Organizes the stored chunks and chooses which to evict (vLLM ``CachePolicy``).

    Contract:
      * The manager owns ref counts and the chunk pool; the policy owns the mapping
        from key to ``ChunkStatus`` and the replacement order. The manager calls
        ``insert`` for every allocated chunk (``ref_cnt == -1``), ``remove`` after a
        failed store, ``mark_non_evictable`` on a 0 -> 1 ref-count transition and
        ``mark_evictable`` on every transition to 0.
      * ``evict(n, protected)`` returns exactly ``n`` (key, chunk) pairs or None, and is
        atomic: on None no state changes. It only ever returns chunks with
        ``ref_cnt == 0``: write-pending (-1) and pinned (> 0) chunks and keys in
        ``protected`` are never chosen. Returned chunks are no longer in the policy.
      * Recency hooks (``touch``, ``on_store_miss``, ``on_request_access``,
        ``on_request_finished``) may be called for keys that are absent; they must
        ignore (or, for ARC, learn from) them and never raise.
      * Not thread-safe: one scheduler thread drives the manager, which calls the
        policy; callers serialize access (vLLM holds ``manager.lock``).

    Args:
      cache_capacity: The number of chunks of the store (ARC bounds its ghost lists by
        it).
    """

    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity

    @abc.abstractmethod
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        """Returns the chunk stored under ``key``, or None if absent."""

    @abc.abstractmethod
    def insert(self, key: OffloadKey, chunk: ChunkStatus, ctx: RequestContext | None) -> None:
        """Adds a newly allocated (write-pending) chunk."""

    @abc.abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Drops a present chunk (the cleanup of a failed store)."""

    @abc.abstractmethod
    def touch(self, keys: Sequence[OffloadKey], ctx: RequestContext | None) -> None:
        """Marks ``keys`` as recently used; the first key ends the most recent."""

    def on_store_miss(self, keys: Sequence[OffloadKey], ctx: RequestContext | None) -> None:
        """Observes keys a request is about to store (absent now). Default: ``touch``."""
        self.touch(keys, ctx)

    def on_request_access(  # noqa: B027 - an optional hook, a no-op by default
        self, keys: Sequence[OffloadKey], ctx: RequestContext
    ) -> None:
        """Observes keys a request stores or loads, in offer order. Default: no-op."""

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        ctx: RequestContext,
    ) -> None:
        """Applies a finished request's accesses, once per request.

        Args:
          key_groups: Keys the request stored or loaded, one head-to-tail sequence per
            KV-cache group, groups in ascending index order.
          insertion_only_keys: Keys the request only inserted (a store is not a reuse).
          reused_keys: Ready keys the request actually reused (loaded or re-offered).
          ctx: The request's context (positions).

        The default touches each group.
        """
        del insertion_only_keys, reused_keys
        for keys in key_groups:
            self.touch(keys, ctx)

    @abc.abstractmethod
    def evict(
        self, n: int, protected: set[OffloadKey]
    ) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """Removes exactly ``n`` idle, unprotected chunks, or nothing and returns None."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Drops every chunk regardless of ref count, and all adaptive state."""

    def mark_evictable(self, key: OffloadKey) -> None:  # noqa: B027 - optional hook
        """Called when the chunk of ``key`` reaches ref count 0."""

    def mark_non_evictable(self, key: OffloadKey) -> None:  # noqa: B027 - optional hook
        """Called when the chunk of ``key`` leaves ref count 0 (a load pins it)."""
