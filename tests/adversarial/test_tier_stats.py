"""`KVOffloader.stats()` with secondary tiers: exact, consistent with itself, and the
same as without tiers where the tiers add nothing.

`hit_tokens` counts the chunks a lookup found: answered HIT by the host, or held by a
tier (being promoted, or promoted by this lookup). It used to count the prefix the
lookup returned instead, so attaching an empty tier changed it (a sliding window of 1
chunk: 3 chunks of tokens for 1 hit; a gap after the first chunk: 1 for 3 hits)."""

from __future__ import annotations

import dataclasses
import sys
import threading

import pytest

from tests.faults._helpers import BS, config, hashes, offloader, write_blocks
from tests.faults._tiers import FakeTier

CHUNK_TOKENS = 2 * BS


def scenario(window, tier):
    """Stores two of three chunks (a gap in the middle), looks the three up."""
    off = offloader(config(window=window), tiers=None if tier is None else [tier])
    h = hashes("g", 6)
    write_blocks(off, list(range(6)), h)
    if window is None:  # chunks 0 and 2 (a chunk's key is its last block's hash): a gap
        other = [b"w" * 32, b"x" * 32, b"y" * 32, b"z" * 32, *h[4:]]
        off.wait([off.store(h[:2], [0, 1]), off.store(other, [6, 7, 8, 9, 4, 5])])
    else:  # a window of one chunk: only the last chunk is stored
        off.wait([off.store(h, list(range(6)))])
    if tier is not None:
        assert off.flush_tiers(timeout=30)
        tier.entries.clear()  # the tier adds nothing to the lookup
    n = off.lookup(h)
    stats = off.stats()
    off.close()
    return n, stats


@pytest.mark.parametrize("window", [None, 4])
def test_an_empty_tier_changes_no_count(window):
    n, plain = scenario(window, None)
    tier = FakeTier()
    n_tiered, tiered = scenario(window, tier)
    tier.close()
    assert n == n_tiered
    timeless = {"tiers": (), "store": plain.store, "load": plain.load}  # seconds differ
    assert dataclasses.replace(tiered, **timeless) == plain
    assert (tiered.store.jobs, tiered.store.bytes) == (plain.store.jobs, plain.store.bytes)
    assert plain.hit_tokens == plain.hits * CHUNK_TOKENS


def test_chunks_found_in_a_tier_count_as_hit_tokens():
    tier = FakeTier()
    first = offloader(config(), tiers=[tier])
    h = hashes("t", 6)
    write_blocks(first, list(range(6)), h)
    first.wait([first.store(h, list(range(6)))])
    assert first.flush_tiers(timeout=30)
    first.close()
    off = offloader(config(), seed=2, tiers=[tier])
    assert off.lookup(h[:2], wait=False) == 0  # chunk 0: promotion started
    assert off.lookup(h) == 6  # chunk 0 promoting, chunks 1-2 in the tier
    s = off.stats()
    (t,) = s.tiers
    assert t.promoted == 3
    assert (s.lookups, s.hits, s.hits_pending, s.misses) == (4, 0, 1, 3)
    assert s.hit_tokens == 4 * CHUNK_TOKENS  # 1 + 3 answers found something
    assert s.prefix_hit_tokens == 6 * BS
    off.close()
    tier.close()


def test_snapshots_from_another_thread_never_go_down_while_jobs_complete():
    tier = FakeTier()
    off = offloader(config(chunks=6), tiers=[tier])
    stop = threading.Event()
    seen: list = []
    errors: list = []

    def watch():
        try:
            check()
        except BaseException as e:  # reported on the test's thread
            errors.append(e)

    def check():
        last = None
        while not stop.is_set():
            s = off.stats()
            assert 0.0 <= s.cpu_cache_usage_perc <= 1.0 and 0.0 <= s.occupancy_perc <= 1.0
            if last is not None:
                d = s.since(last)
                counters = [d.lookups, d.hits, d.misses, d.stores_completed, d.evictions,
                            d.store.jobs, d.load.jobs, *(x for t in d.tiers for x in
                            (t.cascaded, t.promoted, t.dropped, t.failed))]  # fmt: skip
                assert min(counters) >= 0, d
            last = s
            seen.append(s)

    watcher = threading.Thread(target=watch)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # thread switches between any two reads of a snapshot
    watcher.start()
    try:
        for i in range(30):
            h = hashes(f"p{i % 7}", 4)
            write_blocks(off, [0, 1, 2, 3], h)
            off.wait([off.store(h, [0, 1, 2, 3])])
            n = off.lookup(h)
            if n:
                off.wait([off.load(h[:n], list(range(10, 10 + n)))])
            if i % 11 == 10:
                off.reset_cache()
        off.close()
    finally:
        stop.set()
        watcher.join(30)
        sys.setswitchinterval(switch)
        tier.close()
    assert not errors, errors[0]
    assert len(seen) > 10


def test_a_snapshot_taken_while_the_caller_stores_keeps_its_gauges_in_range(monkeypatch):
    # stats() reads the store's gauges without stopping the caller's thread: a chunk
    # allocated and completed between its reads of the occupancy and of the evictable
    # count (forced here at that exact point) used to give a negative usage gauge.
    from jax_kvoffload.store import HostStore

    off = offloader(config())
    store = off._store
    real = HostStore.num_occupied_chunks
    once = []

    def occupied(self):
        value = real.fget(self)
        if not once:  # the caller's thread runs a whole store right after this read
            once.append(1)
            out = store.prepare_store([b"k" * 36])
            store.complete_store(list(out.keys_to_store))
        return value

    monkeypatch.setattr(HostStore, "num_occupied_chunks", property(occupied))
    s = off.stats()
    monkeypatch.undo()
    assert 0.0 <= s.cpu_cache_usage_perc <= s.occupancy_perc <= 1.0, s
    off.close()
