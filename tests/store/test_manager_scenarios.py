"""vLLM 0.33.0 manager cases (vLLM's cpu/test_manager.py, G1-G8), narrated, for LRU and ARC.

Capacity 4 and events on unless stated; one request context is shared by every call.
"""

from __future__ import annotations

import pytest

from jax_kvoffload.store import (
    KeyNotPinnedError,
    KeyNotReadyError,
    KeyNotStoredError,
    LookupResult,
    Medium,
    OffloadingEvent,
    PrepareStoreOutput,
    UnknownPolicyError,
)

from ._helpers import K, Ks, make_store

MISS, HIT, PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING


def out(keys, chunks, evicted=()):
    return PrepareStoreOutput(tuple(Ks(*keys)), tuple(chunks), tuple(Ks(*evicted)))


def stored(*ids):
    return OffloadingEvent(tuple(Ks(*ids)), Medium.CPU, removed=False)


def removed(*ids, metadata_only=False):
    return OffloadingEvent(tuple(Ks(*ids)), Medium.CPU, removed=True, metadata_only=metadata_only)


def test_g1_full_scenario(policy_name, ctx):
    m = make_store(4, policy_name)

    # store [1, 2]: fresh chunks 0, 1; both write-pending, so not readable yet.
    assert m.prepare_store(Ks(1, 2), ctx) == out([1, 2], [0, 1])
    assert m.lookup(K(1), ctx) is PENDING
    assert m.take_events() == []

    m.complete_store(Ks(1, 2), ctx=ctx)
    assert m.take_events() == [stored(1, 2)]
    assert [m.lookup(k, ctx) for k in Ks(1, 2, 3)] == [HIT, HIT, MISS]

    # 2 is already stored (and protected as part of the offer); 3, 4, 5 need three
    # chunks, two are fresh (2, 3): 1 is evicted and its chunk 0 reused.
    assert m.prepare_store(Ks(2, 3, 4, 5), ctx) == out([3, 4, 5], [2, 3, 0], [1])
    assert m.take_events() == [removed(1)]

    # Only 2 is evictable (3, 4, 5 are write-pending): two chunks cannot be freed.
    assert m.prepare_store(Ks(1, 6), ctx) is None

    m.complete_store(Ks(2, 3, 4, 5), ctx=ctx)
    assert [m.lookup(k, ctx) for k in Ks(1, 2, 3, 4, 5, 0)] == [MISS, HIT, HIT, HIT, HIT, MISS]

    # Loading 2, 3 pins them: only 4 and 5 are evictable, three are needed.
    assert m.prepare_load(Ks(2, 3), ctx) == (1, 2)
    assert m.prepare_store(Ks(6, 7, 8), ctx) is None
    m.complete_load(Ks(2, 3), ctx)

    # Order is now 2, 3, 4, 5: storing three evicts 2, 3, 4; freed chunks 1, 2, 3
    # are reused last-freed first.
    assert m.prepare_store(Ks(6, 7, 8), ctx) == out([6, 7, 8], [3, 2, 1], [2, 3, 4])
    m.complete_store(Ks(6, 7, 8), ctx=ctx)

    # Touching 5, 6, 7 leaves 8 least recent.
    m.touch(Ks(5, 6, 7), ctx)
    assert m.prepare_store(Ks(9), ctx) == out([9], [1], [8])

    # 7 is ready, so a failed completion leaves it; 9 is dropped.
    m.complete_store(Ks(7, 9), success=False, ctx=ctx)
    assert m.lookup(K(7), ctx) is HIT
    assert m.lookup(K(9), ctx) is MISS

    assert m.take_events() == [
        stored(3, 4, 5),
        removed(2, 3, 4),
        stored(6, 7, 8),
        removed(8),
        removed(9, metadata_only=True),
    ]


def test_g2_offered_key_is_protected_from_eviction(policy_name, ctx):
    """Regression: 2 is least recent but part of the offer, so 1 goes instead."""
    m = make_store(4, policy_name)
    m.prepare_store(Ks(1, 2), ctx)
    m.complete_store(Ks(1, 2), ctx=ctx)
    m.touch(Ks(1), ctx)  # order is now 2, 1
    assert m.prepare_store(Ks(2, 3, 4, 5), ctx) == out([3, 4, 5], [2, 3, 0], [1])
    m.complete_store(Ks(2, 3, 4, 5), ctx=ctx)
    assert m.lookup(K(2), ctx) is HIT


def test_g3_prepare_load_returns_chunks_in_key_order(policy_name, ctx):
    m = make_store(4, policy_name)
    m.prepare_store(Ks(0, 1, 2), ctx)
    m.complete_store(Ks(0, 1, 2), ctx=ctx)
    assert m.prepare_load(Ks(1, 2, 0), ctx) == (1, 2, 0)


def test_g4_store_threshold_and_tracker(policy_name, ctx):
    m = make_store(4, policy_name, store_threshold=2, max_tracker_size=3)
    empty = PrepareStoreOutput((), (), ())

    # First offer only counts: nothing is stored.
    assert m.prepare_store(Ks(1, 2), ctx) == empty
    # Second offer reaches the threshold.
    assert m.prepare_store(Ks(1, 2), ctx) == out([1, 2], [0, 1])
    assert dict(m._tracker.counts) == {K(1): 2, K(2): 2}

    # The tracker holds 3 keys: 4 pushes out the oldest entry, 1.
    assert m.prepare_store(Ks(3, 4), ctx) == empty
    assert dict(m._tracker.counts) == {K(2): 2, K(3): 1, K(4): 1}
    assert m.prepare_store(Ks(5), ctx) == empty
    assert list(m._tracker.counts) == Ks(3, 4, 5)

    # Skipped: 1, 2 (first offer), 3, 4 and 5.
    assert m.get_stats().stores_skipped == 5
    assert m.get_stats().stores_skipped == 0


def test_g4_tracker_never_evicts_keys_of_the_same_offer(policy_name, ctx):
    m = make_store(4, policy_name, store_threshold=2, max_tracker_size=2)
    m.prepare_store(Ks(1, 2), ctx)
    # 1 and 2 are counted again (protected); 3 finds the tracker full of them.
    m.prepare_store(Ks(1, 2, 3), ctx)
    assert dict(m._tracker.counts) == {K(1): 2, K(2): 2}


def test_g4_no_stores_skipped_metric_below_threshold_two(policy_name):
    assert make_store(4, policy_name, store_threshold=1).get_stats().stores_skipped is None


def test_g5_usage_gauges(policy_name, ctx):
    stats = make_store(0, policy_name).get_stats()
    assert stats.cpu_cache_usage_perc == 0.0
    m = make_store(4, policy_name)
    assert m.get_stats().cpu_cache_usage_perc == 0.0

    m.prepare_store(Ks(1, 2), ctx)  # two write-pending chunks
    stats = m.get_stats()
    assert (stats.cpu_cache_usage_perc, stats.cpu_cache_write_usage_perc) == (0.5, 0.5)
    assert stats.cpu_cache_read_usage_perc == 0.0
    assert stats.cpu_allocation_size == (2,)  # one allocation of two chunks

    m.complete_store(Ks(1, 2), ctx=ctx)
    assert m.get_stats().cpu_cache_usage_perc == 0.0

    m.prepare_load(Ks(1), ctx)  # one pinned chunk
    stats = m.get_stats()
    assert stats.cpu_cache_usage_perc == stats.cpu_cache_read_usage_perc == 0.25
    assert stats.cpu_allocation_size == ()

    m.prepare_store(Ks(3, 4), ctx)
    stats = m.get_stats()
    assert stats.cpu_cache_usage_perc == 0.75
    assert stats.cpu_cache_write_usage_perc == 0.5
    assert stats.cpu_cache_read_usage_perc == 0.25


def test_g6_evictable_counter(policy_name, ctx, monkeypatch):
    m = make_store(4, policy_name)
    m.prepare_store(Ks(1, 2, 3), ctx)
    assert m.num_evictable_chunks == 0
    m.complete_store(Ks(1, 2, 3), ctx=ctx)
    assert m.num_evictable_chunks == 3

    # Two nested loads of 1: one 0 -> 1 transition, no double decrement.
    m.prepare_load(Ks(1), ctx)
    m.prepare_load(Ks(1), ctx)
    assert m.num_evictable_chunks == 2
    m.complete_load(Ks(1), ctx)
    assert m.num_evictable_chunks == 2
    m.complete_load(Ks(1), ctx)
    assert m.num_evictable_chunks == 3

    assert m.prepare_store(Ks(4, 5, 6), ctx) == out([4, 5, 6], [3, 1, 0], [1, 2])
    assert m.num_evictable_chunks == 1
    m.complete_store(Ks(4, 5, 6), success=False, ctx=ctx)
    assert (m.num_evictable_chunks, m.num_free_chunks) == (1, 3)

    m.reset_cache()
    assert (m.num_evictable_chunks, m.num_free_chunks) == (0, 4)

    m.prepare_store(Ks(10, 11, 12), ctx)
    m.complete_store(Ks(10, 11, 12), ctx=ctx)
    m.prepare_load(Ks(10, 11, 12), ctx)
    calls = []
    real_evict = m.policy.evict
    monkeypatch.setattr(m.policy, "evict", lambda n, p: calls.append(n) or real_evict(n, p))
    # One chunk free, one more needed, nothing evictable: the fast path answers.
    assert m.prepare_store(Ks(14, 15), ctx) is None
    assert calls == []

    m.complete_load(Ks(10, 11, 12), ctx)
    assert m.prepare_store(Ks(14, 15), ctx) == out([14, 15], [3, 0], [10])
    assert calls == [1]
    assert m.num_evictable_chunks == 2
    m.complete_store(Ks(14, 15), ctx=ctx)
    assert m.num_evictable_chunks == 4


def test_g7_errors(policy_name, ctx):
    m = make_store(4, policy_name)
    with pytest.raises(KeyNotStoredError, match="not found in cache"):
        m.prepare_load(Ks(1), ctx)
    m.prepare_store(Ks(1), ctx)
    with pytest.raises(KeyNotReadyError, match="is not ready for reading"):
        m.prepare_load(Ks(1), ctx)
    m.complete_store(Ks(1), ctx=ctx)
    with pytest.raises(KeyNotPinnedError, match="ref_cnt is already 0"):
        m.complete_load(Ks(1), ctx)
    with pytest.raises(KeyNotStoredError, match="not found in cache"):
        m.complete_load(Ks(2), ctx)


def test_g7_unknown_policy_has_vllms_text():
    expected = (
        "Unknown cache policy: 'bogus'. Supported: ['lru', 'arc']. "
        "For an out-of-tree policy, also set cache_policy_module_path."
    )
    with pytest.raises(UnknownPolicyError) as info:
        make_store(4, "bogus")
    assert str(info.value) == expected
    assert isinstance(info.value, ValueError)


def test_g8_duplicate_keys_are_not_deduplicated(policy_name, ctx):
    m = make_store(4, policy_name)
    assert m.prepare_store(Ks(1, 1), ctx) == out([1, 1], [0, 1])
    assert m.num_write_pending_chunks == 2
