"""Policy specifics: ARC (vLLM's test_manager.py G9), LRU (G10), the registry and the contract."""

from __future__ import annotations

import re

import pytest

from jax_kvoffload.store import (
    AbstractEvictionPolicy,
    ARCPolicy,
    ChunkStatus,
    DuplicatePolicyError,
    LookupResult,
    LRUPolicy,
    RequestContext,
    UnknownPolicyError,
    get_policy_class,
    policy_names,
    register_policy,
    unregister_policy,
)

from ._helpers import K, Ks, make_store
from ._policy_contract import run_policy_contract


def stored_store(num_chunks, policy, ids, ctx):
    m = make_store(num_chunks, policy)
    m.prepare_store(Ks(*ids), ctx)
    m.complete_store(Ks(*ids), ctx=ctx)
    return m


# --- ARC (G9) ---


def test_arc_insert_goes_to_t1(ctx):
    arc = stored_store(4, "arc", [1, 2], ctx).policy
    assert (list(arc.t1), list(arc.t2)) == (Ks(1, 2), [])


def test_arc_touch_promotes_ready_chunks_only(ctx):
    m = stored_store(4, "arc", [1, 2], ctx)
    m.touch(Ks(1), ctx)
    assert (list(m.policy.t1), list(m.policy.t2)) == (Ks(2), Ks(1))
    m.prepare_store(Ks(3), ctx)
    m.touch(Ks(3), ctx)  # 3 is write-pending: touching it is not a second use
    assert (list(m.policy.t1), list(m.policy.t2)) == (Ks(2, 3), Ks(1))


def test_arc_pinned_chunks_block_eviction_until_unpinned(ctx):
    m = stored_store(4, "arc", [1, 2, 3, 4], ctx)
    m.prepare_load(Ks(2, 3), ctx)
    assert m.prepare_store(Ks(5, 6, 7), ctx) is None  # only 1 and 4 are idle
    m.complete_load(Ks(2, 3), ctx)
    output = m.prepare_store(Ks(5, 6, 7), ctx)
    assert output.chunk_ids == (2, 1, 0)
    assert output.evicted_keys == tuple(Ks(1, 2, 3))
    assert list(m.policy.t1) == Ks(4, 5, 6, 7)
    assert list(m.policy.b1) == Ks(1, 2, 3)


def test_arc_ghost_hit_in_b1_raises_target(ctx):
    m = stored_store(2, "arc", [1, 2], ctx)
    output = m.prepare_store(Ks(3), ctx)
    assert (output.evicted_keys, output.chunk_ids) == ((K(1),), (0,))
    assert list(m.policy.b1) == Ks(1)
    assert m.policy.target_t1_size == 0
    m.touch(Ks(1), ctx)  # a miss on a B1 ghost: recency matters more
    assert m.policy.target_t1_size == 1


def test_arc_target_chooses_between_t1_and_t2(ctx):
    m = stored_store(4, "arc", [1, 2, 3, 4], ctx)
    m.touch(Ks(3, 4), ctx)
    assert (list(m.policy.t1), list(m.policy.t2)) == (Ks(1, 2), Ks(4, 3))

    # |T1| = 2 >= target 1: evict T1's LRU chunk.
    m.policy.target_t1_size = 1
    output = m.prepare_store(Ks(5), ctx)
    assert (output.evicted_keys, output.chunk_ids) == ((K(1),), (0,))
    assert (list(m.policy.t1), list(m.policy.b1)) == (Ks(2, 5), Ks(1))
    m.complete_store(Ks(5), ctx=ctx)

    # |T1| = 2 < target 3: evict T2's LRU chunk, 4.
    m.policy.target_t1_size = 3
    output = m.prepare_store(Ks(6), ctx)
    assert (output.evicted_keys, output.chunk_ids) == ((K(4),), (3,))
    assert list(m.policy.b2) == Ks(4)


def test_arc_ghost_lists_bounded_by_capacity(ctx):
    m = make_store(2, "arc")
    for i in range(3, 20):
        m.prepare_store(Ks(i), ctx)
        m.complete_store(Ks(i), ctx=ctx)
    assert list(m.policy.b1) == Ks(16, 17)
    assert list(m.policy.t1) == Ks(18, 19)


def test_arc_touch_order_reverse_and_t2_mru(ctx):
    m = stored_store(4, "arc", [1, 2, 3, 4], ctx)
    m.touch(Ks(3, 4), ctx)
    m.touch(Ks(1, 3, 4), ctx)
    assert (list(m.policy.t1), list(m.policy.t2)) == (Ks(2), Ks(4, 3, 1))
    output = m.prepare_store(Ks(5), ctx)
    assert (output.evicted_keys, output.chunk_ids) == ((K(2),), (1,))


def test_arc_failed_store_is_not_kept(ctx):
    m = stored_store(4, "arc", [1, 2, 3, 4], ctx)
    assert m.prepare_store(Ks(5), ctx).evicted_keys == (K(1),)
    m.complete_store(Ks(5), success=False, ctx=ctx)
    assert m.lookup(K(5), ctx) is LookupResult.MISS
    assert K(5) not in m.policy.t1 and K(5) not in m.policy.t2
    assert list(m.policy.b1) == Ks(1)


def test_arc_request_scoped_accesses():
    m = make_store(4, "arc")
    r1 = RequestContext("r1")
    for i, position in ((1, 16), (2, 32), (3, 48)):
        r1.set_key_position(K(i), position)
    m.prepare_store(Ks(1, 2, 3), r1)
    m.complete_store(Ks(1, 2, 3), ctx=r1)
    m.on_request_finished(r1)
    # Stored only: stays in T1, head (1) most recent.
    assert list(m.policy.t1) == Ks(3, 2, 1)

    r2 = RequestContext("r2")
    m.prepare_load(Ks(1, 2), r2)
    m.complete_load(Ks(1, 2), r2)
    m.on_request_finished(r2)
    # Reused: promoted to T2 in reverse prefix order.
    assert (list(m.policy.t1), list(m.policy.t2)) == (Ks(3), Ks(2, 1))


def test_arc_store_miss_adapts_once_per_request():
    m = make_store(2, "arc")
    setup = RequestContext("setup")
    m.prepare_store(Ks(1, 2), setup)
    m.complete_store(Ks(1, 2), ctx=setup)
    m.prepare_store(Ks(3), setup)  # evicts 1 into B1
    m.complete_store(Ks(3), ctx=setup)
    m.prepare_load(Ks(2, 3), setup)  # both pinned: offering 1 cannot allocate
    r = RequestContext("r")
    assert m.prepare_store(Ks(1), r) is None
    assert m.policy.target_t1_size == 1  # the B1 ghost was seen
    assert m.prepare_store(Ks(1), r) is None
    assert m.policy.target_t1_size == 1  # ...once for this request
    assert m.prepare_store(Ks(1), RequestContext("other")) is None
    assert m.policy.target_t1_size == 2


# --- LRU (G10) ---


def test_lru_request_ranks_put_tail_before_head():
    m = make_store(4, "lru")
    a = RequestContext("a")
    for i, position in ((1, 16), (2, 32), (3, 48)):
        a.set_key_position(K(i), position)
    m.prepare_store(Ks(1, 2, 3), a)
    m.complete_store(Ks(1, 2, 3), ctx=a)
    ranks = [m.policy.rank(k) for k in Ks(1, 2, 3)]
    r = ranks[0][0]
    assert ranks == [(r, -16), (r, -32), (r, -48)]

    # While a request runs, its tail (3) is the oldest: with 3 chunks, another
    # request's store evicts 3.
    m2, a2 = make_store(3, "lru"), RequestContext("a2")
    for i, position in ((1, 16), (2, 32), (3, 48)):
        a2.set_key_position(K(i), position)
    m2.prepare_store(Ks(1, 2, 3), a2)
    m2.complete_store(Ks(1, 2, 3), ctx=a2)
    assert m2.prepare_store(Ks(4), RequestContext("b")).evicted_keys == (K(3),)

    # When a finishes its keys are re-ranked head last: 3 oldest, 1 newest.
    m.on_request_finished(a)
    r3, r2, r1 = (m.policy.rank(k) for k in Ks(3, 2, 1))
    assert r3 < r2 < r1 and r3[0] > r

    # A position-less insert of another request takes a fresh global rank.
    b = RequestContext("b")
    m.prepare_store(Ks(4), b)
    m.complete_store(Ks(4), ctx=b)
    assert m.policy.rank(K(4)) > r1 and m.policy.rank(K(4))[1] == 0

    output = m.prepare_store(Ks(5, 6), b)
    assert output.evicted_keys == tuple(Ks(3, 2))
    assert output.chunk_ids == (1, 2)  # 3 freed chunk 2, then 2 freed chunk 1: LIFO


def test_lru_request_rank_is_shared_across_batches():
    m = make_store(8, "lru")
    a = RequestContext("a")
    for i in range(1, 5):
        a.set_key_position(K(i), 16 * i)
    m.prepare_store(Ks(1, 2), a)
    m.prepare_store(Ks(9), RequestContext("b"))  # another request stores in between
    m.prepare_store(Ks(3, 4), a)
    ranks = [m.policy.rank(k) for k in Ks(1, 2, 3, 4)]
    assert len({rank[0] for rank in ranks}) == 1
    assert ranks == sorted(ranks, reverse=True)  # tail smallest
    # a's rank was taken at its first access, before b's key.
    assert ranks[0] < m.policy.rank(K(9))


def test_lru_touch_makes_untouched_key_the_victim(ctx):
    m = stored_store(4, "lru", [1, 2, 3], ctx)
    m.touch(Ks(1, 2), ctx)  # order is now 3, 2, 1
    assert m.prepare_store(Ks(4, 5), ctx).evicted_keys == (K(3),)


def test_lru_touch_ranks_first_key_most_recent(ctx):
    m = stored_store(4, "lru", [1, 2, 3, 4], ctx)
    m.touch(Ks(1, 2, 3), ctx)  # order is now 4, 3, 2, 1
    assert m.prepare_store(Ks(5, 6, 7), ctx).evicted_keys == tuple(Ks(4, 3, 2))


def test_lru_pinned_chunk_keeps_logical_recency(ctx):
    m = stored_store(3, "lru", [1, 2, 3], ctx)
    m.prepare_load(Ks(1), ctx)
    m.touch(Ks(2), ctx)  # order is now 1, 3, 2 but 1 is pinned
    assert m.prepare_store(Ks(4), ctx).evicted_keys == (K(3),)
    m.complete_load(Ks(1), ctx)
    m.complete_store(Ks(4), ctx=ctx)
    assert m.prepare_store(Ks(5), ctx).evicted_keys == (K(1),)


def test_lru_evict_is_atomic():
    lru = LRUPolicy(4)
    for i in range(3):
        chunk = ChunkStatus(i)
        lru.insert(K(i), chunk, None)
        chunk.ref_cnt = 0
        lru.mark_evictable(K(i))
    assert lru.evict(3, {K(0)}) is None
    assert [lru.get(K(i)) is not None for i in range(3)] == [True] * 3
    assert [key for key, _ in lru.evict(2, {K(0)})] == Ks(1, 2)
    assert lru.evict(0, set()) == []


def test_arc_evict_is_atomic():
    arc = ARCPolicy(4)
    for i in range(3):
        chunk = ChunkStatus(i)
        arc.insert(K(i), chunk, None)
        chunk.ref_cnt = 0
    assert arc.evict(3, {K(0)}) is None
    assert list(arc.t1) == Ks(0, 1, 2) and not arc.b1
    assert [key for key, _ in arc.evict(2, {K(0)})] == Ks(1, 2)


# --- registry ---


def test_registry_builtins_and_duplicates():
    assert policy_names()[:2] == ("lru", "arc")
    assert get_policy_class("arc") is ARCPolicy
    with pytest.raises(
        DuplicatePolicyError, match=re.escape("Cache policy 'lru' is already registered.")
    ):
        register_policy("lru", LRUPolicy)
    with pytest.raises(TypeError, match="subclass of AbstractEvictionPolicy"):
        register_policy("x", dict)  # type: ignore[arg-type]


class FIFOPolicy(AbstractEvictionPolicy):
    """Module-level so that ``cache_policy_module_path`` can import it."""

    def __init__(self, cache_capacity):
        super().__init__(cache_capacity)
        self.chunks = {}

    def get(self, key):
        return self.chunks.get(key)

    def insert(self, key, chunk, ctx):
        self.chunks[key] = chunk

    def remove(self, key):
        del self.chunks[key]

    def touch(self, keys, ctx):
        pass

    def evict(self, n, protected):
        victims = [k for k, c in self.chunks.items() if c.ref_cnt == 0 and k not in protected]
        if len(victims) < n:
            return None
        return [(k, self.chunks.pop(k)) for k in victims[:n]]

    def clear(self):
        self.chunks.clear()


def test_out_of_tree_policy_by_module_path(ctx):
    m = make_store(2, "FIFOPolicy", cache_policy_module_path=__name__)
    assert type(m.policy) is FIFOPolicy
    m.prepare_store(Ks(1, 2), ctx)
    m.complete_store(Ks(1, 2), ctx=ctx)
    m.touch(Ks(1), ctx)
    assert m.prepare_store(Ks(3), ctx).evicted_keys == (K(1),)
    with pytest.raises(TypeError, match="must be a subclass"):
        make_store(2, "K", cache_policy_module_path=__name__)


@pytest.mark.parametrize("name", policy_names())
def test_every_registered_policy_passes_the_contract(name):
    run_policy_contract(name)


class PinIgnoringPolicy(FIFOPolicy):
    """Evicts in insertion order and forgets to skip pinned chunks."""

    def evict(self, n, protected):
        victims = [k for k in self.chunks if k not in protected]
        if len(victims) < n:
            return None
        return [(k, self.chunks.pop(k)) for k in victims[:n]]


def test_the_contract_sees_a_policy_that_evicts_a_pinned_chunk():
    register_policy("pin-ignoring", PinIgnoringPolicy)
    try:
        with pytest.raises(AssertionError, match="evicted a pinned, pending or offered key"):
            run_policy_contract("pin-ignoring")
    finally:
        assert unregister_policy("pin-ignoring") is PinIgnoringPolicy
    assert "pin-ignoring" not in policy_names()


def test_unregister_keeps_the_built_ins():
    for name in ("lru", "arc", "never-registered"):
        with pytest.raises(UnknownPolicyError, match=repr(name)):
            unregister_policy(name)
    assert policy_names()[:2] == ("lru", "arc")
