"""What the policy hears: the hook calls vLLM 0.33.0's manager makes, no more, no fewer.

A recording policy wraps the built-in ones. vLLM's `_record_request_cache_access` tells
the policy about a key once per request (`on_request_access` with the keys first seen)
and counts a store candidate as inserted only once its chunk was allocated; custom
policies see exactly that. The narrated LRU case shows the eviction a second
`on_request_access` would change (found by the differential traces against vLLM).
"""

from __future__ import annotations

from typing import ClassVar

from jax_kvoffload.store import (
    AbstractEvictionPolicy,
    ARCPolicy,
    HostStore,
    LRUPolicy,
    RequestContext,
)

from ._helpers import K, Ks


class Recording(AbstractEvictionPolicy):
    """Delegates to LRU or ARC and logs every hook call (not the pure `get`)."""

    inner_cls: type[AbstractEvictionPolicy] = LRUPolicy
    log: ClassVar[list[tuple]] = []

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.inner = self.inner_cls(cache_capacity)

    def get(self, key):
        return self.inner.get(key)

    def _log(self, *call):
        type(self).log.append(call)

    def insert(self, key, chunk, ctx):
        self._log("insert", key, chunk.chunk_id)
        self.inner.insert(key, chunk, ctx)

    def remove(self, key):
        self._log("remove", key)
        self.inner.remove(key)

    def touch(self, keys, ctx):
        self._log("touch", list(keys))
        self.inner.touch(keys, ctx)

    def on_store_miss(self, keys, ctx):
        self._log("on_store_miss", list(keys))
        self.inner.on_store_miss(keys, ctx)

    def on_request_access(self, keys, ctx):
        self._log("on_request_access", list(keys))
        self.inner.on_request_access(keys, ctx)

    def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, ctx):
        self._log("on_request_finished", key_groups, set(insertion_only_keys), set(reused_keys))
        self.inner.on_request_finished(key_groups, insertion_only_keys, reused_keys, ctx)

    def evict(self, n, protected):
        victims = self.inner.evict(n, protected)
        self._log("evict", n, victims and [k for k, _ in victims])
        return victims

    def clear(self):
        self._log("clear")
        self.inner.clear()

    def mark_evictable(self, key):
        self._log("mark_evictable", key)
        self.inner.mark_evictable(key)

    def mark_non_evictable(self, key):
        self._log("mark_non_evictable", key)
        self.inner.mark_non_evictable(key)


class RecordingLRU(Recording):
    inner_cls = LRUPolicy


class RecordingARC(Recording):
    inner_cls = ARCPolicy


def _store(policy: str, num_chunks: int) -> HostStore:
    """A store running the recording policy (loaded by module path: no global registry
    entry left behind)."""
    Recording.log = []
    name = {"lru": "RecordingLRU", "arc": "RecordingARC"}[policy]
    return HostStore(num_chunks, eviction_policy=name, cache_policy_module_path=__name__)


def _calls(name: str) -> list[tuple]:
    return [c for c in Recording.log if c[0] == name]


def test_on_request_access_once_per_request_and_key(policy_name):
    m = _store(policy_name, 4)
    ctx = RequestContext("r")
    m.prepare_store(Ks(1, 2), ctx)
    m.complete_store(Ks(1, 2), ctx=ctx)
    m.prepare_store(Ks(1, 2, 3), ctx)  # 1, 2 re-offered: already seen by this request
    m.prepare_load(Ks(1), ctx)  # seen too
    assert _calls("on_request_access") == [
        ("on_request_access", Ks(1, 2)),
        ("on_request_access", Ks(3)),
    ]


def test_a_failed_prepare_store_is_no_insertion(policy_name):
    """vLLM passes the candidate of a failed allocation as neither inserted nor reused."""
    m = _store(policy_name, 1)
    a, b = RequestContext("a"), RequestContext("b")
    m.prepare_store(Ks(1), b)  # 1 is write-pending: nothing is evictable
    assert m.prepare_store(Ks(2), a) is None
    m.complete_store(Ks(1), ctx=b)
    m.prepare_store(Ks(2), b)  # b stores 2; a never did
    m.complete_store(Ks(2), ctx=b)
    m.on_request_finished(a)
    assert _calls("on_request_finished") == [("on_request_finished", ((K(2),),), set(), set())]


def test_a_key_stored_by_another_request_after_a_failed_store_counts_as_reused(policy_name):
    m = _store(policy_name, 1)
    a, b = RequestContext("a"), RequestContext("b")
    m.prepare_store(Ks(9), b)  # pending: a's offer cannot be allocated
    assert m.prepare_store(Ks(1), a) is None
    m.complete_store(Ks(9), ctx=b)
    m.prepare_store(Ks(1), b)  # b stores 1 (evicting 9)
    m.complete_store(Ks(1), ctx=b)
    assert m.prepare_load(Ks(1), a) == (0,)  # a reads what b stored: a reuse
    m.complete_load(Ks(1), a)
    m.on_request_finished(a)
    assert _calls("on_request_finished")[-1] == ("on_request_finished", ((K(1),),), set(), {K(1)})


def test_lru_a_request_does_not_re_rank_a_key_it_has_seen():
    """An older request re-inserts k below a key y; a younger one re-offering k (seen
    before) must leave k's rank alone, so k, not y, goes next (vLLM 0.33.0)."""
    m = HostStore(3, eviction_policy="lru")
    a, b = RequestContext("a"), RequestContext("b")
    k, y, f, g, h = K(1), K(2), K(3), K(4), K(5)
    a.set_key_position(y, 8)
    a.set_key_position(k, 16)
    b.set_key_position(k, 16)
    m.prepare_store([y], a)  # a takes request rank 1: y ranks (1, -8)
    m.complete_store([y], ctx=a)
    m.prepare_store([k], b)  # b takes rank 2: k ranks (2, -16)
    m.complete_store([k], ctx=b)
    m.prepare_store([f])  # f ranks (3, 0); the store is full
    m.complete_store([f])
    m.prepare_load([y])  # y pinned: storing g evicts k, the lowest idle rank
    assert m.prepare_store([g]).evicted_keys == (k,)
    m.complete_store([g])
    m.complete_load([y])
    # a stores k again (y offered too, so protected): f goes; k ranks (1, -16) < y.
    assert m.prepare_store([y, k], a).evicted_keys == (f,)
    m.complete_store([k], ctx=a)
    m.prepare_store([k], b)  # b saw k before: no new access, k keeps (1, -16)
    assert m.prepare_store([h]).evicted_keys == (k,)
