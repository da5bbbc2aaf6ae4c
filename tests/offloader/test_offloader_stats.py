"""`KVOffloader.stats()`: every field equals what a narrated scenario implies.

Sizes (tests/offloader/test_offloader.py): 4 tokens per block, 2 blocks per chunk, 256 bytes per
block, so a chunk is 8 tokens and 512 bytes.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest

from jax_kvoffload.stats import OffloadStats, TierStats, TransferTotals
from tests.offloader.test_offloader import BLOCK_BYTES, BS, config, hashes, offloader

CHUNK_BYTES = 2 * BLOCK_BYTES
CHUNK_TOKENS = 2 * BS


def test_a_scripted_scenario_gives_every_field_exactly(monkeypatch):
    off, _ = offloader()
    n = off.num_chunks
    a, b, c = hashes("a", 6), hashes("b", 6), hashes("c", 2)
    with off:
        assert off.stats() == OffloadStats(num_chunks=n, prefix_lookups=0, prefix_hit_tokens=0)

        # Store a's 3 chunks. Until the result is collected the store is pending: a
        # lookup answers HIT_PENDING for each chunk and returns no prefix.
        store_a = off.store(a, [1, 2, 3, 4, 5, 6])
        assert off.lookup(a) == 0
        pending = off.stats()
        assert (pending.lookups, pending.hits_pending, pending.occupied_chunks) == (3, 3, 3)
        # vLLM's usage gauge counts write-pending chunks; the occupancy counts them too.
        assert pending.cpu_cache_usage_perc == pending.occupancy_perc == 3 / n
        (r_store,) = off.wait([store_a])

        # 5 chunk lookups, 2 hits: a's first two chunks, then b's three misses.
        assert off.lookup(a[:4]) == 4
        assert off.lookup(b) == 0

        # Load a's first 2 chunks. While the load is in flight they are pinned: vLLM's
        # usage counts the 2 pinned chunks, the occupancy all 3 stored ones.
        load = off.load(a[:4], [8, 9, 10, 11])
        pinned = off.stats()
        assert (pinned.cpu_cache_usage_perc, pinned.occupancy_perc) == (2 / n, 3 / n)
        (r_load,) = off.wait([load])
        idle = off.stats()
        assert (idle.cpu_cache_usage_perc, idle.occupancy_perc) == (0.0, 3 / n)

        # One store fails (injected): it is counted, its bytes and time are not.
        def boom(*args, **kwargs):
            raise MemoryError("host memory exhausted")

        monkeypatch.setattr(off._pool, "write_blocks", boom)
        (r_failed,) = off.wait([off.store(c, [1, 2])])
        monkeypatch.undo()
        assert not r_failed.success

        before_reset = off.stats()
        off.reset_cache()
        stats = off.stats()

    assert (r_store.size_bytes, r_load.size_bytes) == (3 * CHUNK_BYTES, 2 * CHUNK_BYTES)
    assert stats == OffloadStats(
        lookups=3 + 5,
        hits=2,
        hits_pending=3,
        misses=3,
        hit_tokens=2 * CHUNK_TOKENS,
        prefix_lookups=3,
        prefix_hit_tokens=4 * BS,
        store=TransferTotals(
            jobs_completed=1, jobs_failed=1, bytes=3 * CHUNK_BYTES, seconds=r_store.seconds
        ),
        load=TransferTotals(
            jobs_completed=1, jobs_failed=0, bytes=2 * CHUNK_BYTES, seconds=r_load.seconds
        ),
        stores_completed=3,
        stores_failed=1,
        stores_dropped=0,
        evictions=0,
        resets=1,
        num_chunks=n,
        occupied_chunks=0,
        occupancy_perc=0.0,
        cpu_cache_usage_perc=0.0,
        # The numpy pool (host_pool="auto" on CPU) copies each byte once per direction.
        host_copied_stored=3 * CHUNK_BYTES,
        host_copied_loaded=2 * CHUNK_BYTES,
    )
    # Counters kept counting across the reset; only the gauges dropped.
    assert dataclasses.replace(before_reset, resets=1, occupied_chunks=0, occupancy_perc=0.0) == (
        stats
    )
    assert stats.hit_rate == 2 / 8
    assert stats.store.jobs == 2
    assert stats.load.bytes_per_second == 2 * CHUNK_BYTES / r_load.seconds
    # Closed: the snapshot still works.
    assert off.stats() == stats


def test_the_pinned_pool_copies_no_kv_byte_with_the_cpu():
    off, _ = offloader(host_pool="pinned")
    with off:
        a = hashes("a", 4)
        off.wait([off.store(a, [1, 2, 3, 4])])
        off.wait([off.load(a, [8, 9, 10, 11])])
        s = off.stats()
    assert (s.store.bytes, s.load.bytes) == (2 * CHUNK_BYTES, 2 * CHUNK_BYTES)
    assert (s.host_copied_stored, s.host_copied_loaded) == (0, 0)


def test_a_full_store_counts_evictions_and_the_dropped_offer():
    off, _ = offloader(config(budget=2 * 4096))  # room for exactly two chunks
    with off:
        off.wait([off.store(hashes("a", 4), [0, 1, 2, 3])])
        off.wait([off.store(hashes("b", 4), [4, 5, 6, 7])])  # evicts a's two chunks
        load = off.load(hashes("b", 4), [8, 9, 10, 11])  # pins both of b's
        assert off.store(hashes("c", 2), [12, 13]) is None  # no room: dropped
        off.wait([load])
        s = off.stats()
    assert (s.evictions, s.stores_dropped, s.stores_completed) == (2, 1, 4)
    assert (s.store.jobs_completed, s.load.jobs_completed) == (2, 1)
    assert (s.occupied_chunks, s.occupancy_perc) == (2, 1.0)


def test_a_sliding_window_lookup_counts_its_hit_chunks_and_its_prefix():
    off, _ = offloader(config(window=8))  # a window of 1 chunk: only the last is stored
    h = hashes("a", 6)
    with off:
        off.wait([off.store(h, [1, 2, 3, 4, 5, 6])])
        assert off.lookup(h) == 6  # one chunk hit makes the whole prefix loadable
        s = off.stats()
    assert (s.lookups, s.hits, s.misses) == (3, 1, 2)
    assert (s.hit_tokens, s.prefix_hit_tokens) == (CHUNK_TOKENS, 6 * BS)


def test_since_gives_the_interval_and_keeps_the_gauges():
    off, _ = offloader()
    h = hashes("a", 4)
    with off:
        off.wait([off.store(h, [1, 2, 3, 4])])
        first = off.stats()
        off.lookup(h)
        off.wait([off.load(h, [8, 9, 10, 11])])
        second = off.stats()
    delta = second.since(first)
    assert (delta.lookups, delta.hits, delta.prefix_lookups, delta.hit_tokens) == (2, 2, 1, 16)
    assert delta.store == TransferTotals() and delta.load.jobs_completed == 1
    assert delta.load.bytes == 2 * CHUNK_BYTES
    assert (delta.occupied_chunks, delta.num_chunks) == (2, second.num_chunks)
    tiers = OffloadStats(tiers=(TierStats("disk", cascaded=5, dropped=1),))
    assert tiers.since(OffloadStats(tiers=(TierStats("disk", cascaded=2),))).tiers == (
        TierStats("disk", cascaded=3, dropped=1),
    )


def test_as_dict_is_json_with_the_derived_rates():
    off, _ = offloader()
    with off:
        off.wait([off.store(hashes("a", 2), [1, 2])])
        s = off.stats()
    d = json.loads(json.dumps(s.as_dict()))
    assert d["store"]["bytes"] == CHUNK_BYTES and d["store"]["jobs"] == 1
    assert d["store"]["bytes_per_second"] == pytest.approx(s.store.bytes_per_second)
    assert d["hit_rate"] == 0.0 and d["tiers"] == []
    assert set(d) - {"hit_rate"} == {f.name for f in dataclasses.fields(OffloadStats)}


def test_stats_can_be_taken_from_another_thread_while_a_wait_blocks(monkeypatch):
    off, _ = offloader()
    release, entered = threading.Event(), threading.Event()
    write = off._pool.write_blocks

    def slow_write(*args, **kwargs):
        entered.set()
        release.wait(30)
        return write(*args, **kwargs)

    monkeypatch.setattr(off._pool, "write_blocks", slow_write)
    seen: list[OffloadStats] = []
    with off:
        job = off.store(hashes("a", 2), [1, 2])
        assert entered.wait(30)

        def reader():
            seen.append(off.stats())  # the caller's thread is inside wait(): no guard
            release.set()

        thread = threading.Thread(target=reader)
        thread.start()
        off.wait([job])  # blocks until the reader has taken its snapshot
        thread.join(30)
        after = off.stats()
    assert seen[0].store == TransferTotals() and seen[0].occupied_chunks == 1
    assert after.store.jobs_completed == 1


def test_seconds_are_the_jobs_own_not_the_wait_until_a_poll_collects_it():
    off, _ = offloader()
    with off:
        job = off.store(hashes("a", 2), [1, 2])
        time.sleep(1.0)  # the engine polls rarely: the job ended long before
        results = off.poll() or off.wait([job])
        (result,) = results
        stats = off.stats()
    # Storing 1 KiB takes far less than the second it waited to be collected.
    assert result.success and 0 < result.seconds < 1.0
    assert stats.store.seconds == result.seconds
