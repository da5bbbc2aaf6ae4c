"""Store-side observability: the numbers a scripted scenario implies.

vLLM's gauges keep vLLM's definitions (``cpu_cache_usage_perc`` counts write-pending
and pinned chunks only, so a store full of idle chunks reads 0.0); occupancy and the
cumulative counters (lookups, hits, misses, evictions, store outcomes, allocation
failures) say what the gauges do not.
"""

from __future__ import annotations

from jax_kvoffload.store import HostStore, LookupResult, StoreCounters

from ._helpers import K, Ks

MISS, HIT, PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING


def gauges(m: HostStore) -> tuple:
    s = m.get_stats()
    return (
        s.cpu_cache_usage_perc,
        s.cpu_cache_write_usage_perc,
        s.cpu_cache_read_usage_perc,
        s.occupied_chunks,
        s.occupancy_perc,
    )


def test_a_scripted_scenario_gives_the_implied_numbers(policy_name):
    m = HostStore(4, eviction_policy=policy_name)
    assert m.lookup(K(1)) is MISS

    # 3 chunks write-pending: usage = write usage = 3/4, nothing pinned by loads.
    assert m.prepare_store(Ks(1, 2, 3)).chunk_ids == (0, 1, 2)
    assert m.lookup(K(1)) is PENDING
    assert gauges(m) == (0.75, 0.75, 0.0, 3, 0.75)

    # 1 and 2 complete, 3 fails (its chunk is freed): two idle chunks. vLLM's usage
    # reads 0.0 although half the store holds data; occupancy says 2/4.
    m.complete_store(Ks(1, 2))
    m.complete_store(Ks(3), success=False)
    assert gauges(m) == (0.0, 0.0, 0.0, 2, 0.5)
    assert [m.lookup(k) for k in Ks(1, 2, 3)] == [HIT, HIT, MISS]

    # A load pins 1: read usage 1/4.
    assert m.prepare_load(Ks(1)) == (0,)
    assert gauges(m) == (0.25, 0.0, 0.25, 2, 0.5)

    # Four keys need two evictions but only 2 is idle: the allocation fails.
    assert m.prepare_store(Ks(4, 5, 6, 7)) is None
    m.complete_load(Ks(1))

    # Three keys: one fresh chunk (3), one freed by the failed store (2), one eviction.
    out = m.prepare_store(Ks(4, 5, 6))
    assert len(out.evicted_keys) == 1 and sorted(out.chunk_ids) == [0, 2, 3]
    assert gauges(m) == (0.75, 0.75, 0.0, 4, 1.0)

    stats = m.get_stats()
    assert stats.num_chunks == 4
    assert stats.cpu_allocation_size == ()  # drained by the previous get_stats
    assert stats.counters == StoreCounters(
        lookup_hits=2,
        lookup_hits_pending=1,
        lookup_misses=2,
        evictions=1,
        stores_completed=2,
        stores_failed=1,
        allocation_failures=1,
    )
    assert stats.counters.lookups == 5

    # A reset empties the store; the counters keep counting (they are cumulative).
    m.reset_cache()
    assert gauges(m) == (0.0, 0.0, 0.0, 0, 0.0)
    assert m.lookup(K(2)) is MISS
    assert m.counters().lookup_misses == 3 and m.counters().evictions == 1


def test_allocation_sizes_drain_per_interval_and_counters_do_not():
    m = HostStore(2)
    m.prepare_store(Ks(1))
    m.prepare_store(Ks(2, 3, 4))  # fails: 3 keys, 1 free chunk, nothing evictable
    first = m.get_stats()
    assert first.cpu_allocation_size == (1, 3)
    assert m.get_stats().cpu_allocation_size == ()
    assert m.get_stats().counters.allocation_failures == 1


def test_counters_are_a_snapshot():
    m = HostStore(2)
    snapshot = m.counters()
    snapshot.lookup_hits = 99
    m.lookup(K(1))
    assert m.counters() == StoreCounters(lookup_misses=1)


def test_an_empty_store_reads_zero():
    m = HostStore(0)
    assert m.prepare_store(Ks(1)) is None
    assert gauges(m) == (0.0, 0.0, 0.0, 0, 0.0)
    assert m.counters().allocation_failures == 1
