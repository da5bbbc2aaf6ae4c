"""Fault-ish cases: duplicates, loads racing stores, resets with jobs in flight."""

from __future__ import annotations

import pytest

from jax_kvoffload.store import (
    HostStore,
    KeyNotPinnedError,
    KeyNotReadyError,
    KeyNotStoredError,
    LookupResult,
    OffloadingEvent,
    RequestContext,
    RequestFinishedError,
)

from ._helpers import K, Ks, make_store

MISS, HIT, PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING


def test_duplicate_keys_take_two_chunks_and_one_is_stranded(policy_name):
    """vLLM 0.33.0 behaviour: [1, 1] allocates chunks 0 and 1; the key maps to 1."""
    m = make_store(3, policy_name)
    assert m.prepare_store(Ks(1, 1)).chunk_ids == (0, 1)
    m.complete_store(Ks(1, 1))
    assert m.prepare_load(Ks(1)) == (1,)
    m.complete_load(Ks(1))
    # Chunk 0 stays write-pending, unreachable, until reset_cache.
    assert (m.num_write_pending_chunks, m.num_free_chunks) == (1, 1)
    assert m.prepare_store(Ks(2, 3)).evicted_keys == (K(1),)
    assert m.prepare_store(Ks(4)) is None
    m.reset_cache()
    assert (m.num_write_pending_chunks, m.num_free_chunks) == (0, 3)


def test_duplicate_key_in_a_failed_store(policy_name):
    m = make_store(4, policy_name)
    m.prepare_store(Ks(1, 1))
    m.complete_store(Ks(1, 1), success=False)
    assert m.lookup(K(1)) is MISS
    assert m.take_events() == [OffloadingEvent((K(1),), removed=True, metadata_only=True)]


def test_loading_a_key_while_its_store_is_pending_pins_nothing(policy_name):
    m = make_store(4, policy_name)
    m.prepare_store(Ks(1))
    m.complete_store(Ks(1))
    m.prepare_store(Ks(2))
    with pytest.raises(KeyNotReadyError, match="is not ready for reading"):
        m.prepare_load(Ks(1, 2))
    # 1 was checked first but not pinned: the call is all or nothing.
    assert m.num_evictable_chunks == 1
    with pytest.raises(KeyNotPinnedError):
        m.complete_load(Ks(1))
    with pytest.raises(KeyNotPinnedError):
        m.complete_load(Ks(2))


def test_complete_load_is_all_or_nothing(policy_name):
    m = make_store(4, policy_name)
    m.prepare_store(Ks(1, 2))
    m.complete_store(Ks(1, 2))
    m.prepare_load(Ks(1, 2))
    with pytest.raises(KeyNotPinnedError, match="2 complete_load"):
        m.complete_load(Ks(1, 2, 2))
    assert m.num_evictable_chunks == 0
    m.complete_load(Ks(1, 2))
    assert m.num_evictable_chunks == 2


def test_re_offering_a_pending_key_is_ignored(policy_name):
    m = make_store(4, policy_name)
    m.prepare_store(Ks(1))
    output = m.prepare_store(Ks(1, 2))
    assert output.keys_to_store == (K(2),)
    assert m.lookup(K(1)) is PENDING


def test_retried_store_suppresses_the_metadata_only_removal(policy_name):
    m = make_store(4, policy_name)
    m.prepare_store(Ks(1, 2))
    m.complete_store(Ks(1, 2), success=False)
    m.prepare_store(Ks(1))  # retry re-allocates 1 before the events are drained
    assert m.take_events() == [OffloadingEvent((K(2),), removed=True, metadata_only=True)]
    assert m.take_events() == []


def test_reset_with_loads_and_stores_in_flight(policy_name):
    m = make_store(4, policy_name)
    m.prepare_store(Ks(1, 2))
    m.complete_store(Ks(1, 2))
    m.prepare_load(Ks(1))  # load in flight
    m.prepare_store(Ks(3))  # store in flight
    generation = m.cache_generation
    m.reset_cache()
    assert m.cache_generation == generation + 1
    assert [m.lookup(k) for k in Ks(1, 2, 3)] == [MISS, MISS, MISS]
    assert m.num_free_chunks == 4
    stats = m.get_stats()
    assert stats.cpu_cache_usage_perc == stats.cpu_cache_write_usage_perc == 0.0
    # Stale completions: a store of a key not re-stored is a no-op; a load is an error
    # (vLLM's scheduler fences both by job id and never sends them).
    m.complete_store(Ks(3))
    assert m.lookup(K(3)) is MISS
    with pytest.raises(KeyNotStoredError):
        m.complete_load(Ks(1))
    # The pool starts again from chunk 0.
    assert m.prepare_store(Ks(4, 5)).chunk_ids == (0, 1)


def test_reset_starts_request_state_afresh():
    m = make_store(4, "lru")
    r = RequestContext("r")
    m.prepare_store(Ks(1), r)
    m.on_request_finished(r)
    with pytest.raises(RequestFinishedError, match="already finished"):
        m.prepare_store(Ks(2), r)
    m.prepare_store(Ks(1), r)  # a key it has seen is fine
    m.reset_cache()
    assert m.prepare_store(Ks(2), r).keys_to_store == (K(2),)


def test_events_off_by_default():
    m = HostStore(2)
    m.prepare_store(Ks(1))
    m.complete_store(Ks(1))
    assert m.take_events() == []


def test_type_errors():
    m = make_store(2)
    with pytest.raises(TypeError, match="single bytes"):
        m.prepare_store(K(1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be bytes"):
        m.prepare_load(["1"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="key must be bytes"):
        m.lookup("1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="success must be a bool"):
        m.complete_store(Ks(1), success=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has 1 bytes"):
        m.prepare_store([b"x"])
    with pytest.raises(TypeError, match="req_id must be a str"):
        RequestContext(1)  # type: ignore[arg-type]
