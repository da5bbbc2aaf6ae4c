"""MooncakeTier on a real Mooncake Store that misbehaves: the master killed and
restarted, a storage node holding entries killed, the store full and evicting on its
own. Checked each time: misses and counted failures or drops, every call within a
bound, no exception, no wrong byte (every hit is compared with the stored payload), and
the tier serving again once the store is back. (A damaged value: `test_mooncake.py`.)
"""

from __future__ import annotations

import secrets
import time

import numpy as np
import pytest

from jax_kvoffload.tiers import MooncakeTier, MooncakeTierConfig

from ._helpers import key, payload
from ._mooncake import NO_MOONCAKE, MooncakeStore

pytestmark = pytest.mark.skipif(NO_MOONCAKE is not None, reason=str(NO_MOONCAKE))

N = 64 << 10
# Mooncake's client gives up on a master that went away after ~4.3 s (one reconnect);
# after the first such call the tier does not ask again for `retry_after_s`.
CALL_BOUND_S = 6.0


def open_tier(store: MooncakeStore, **kw) -> MooncakeTier:
    kw = {"retry_after_s": 0.5, "read_threads": 2, "write_threads": 2, **kw}
    return MooncakeTier(MooncakeTierConfig(**store.options(), **kw), secrets.token_bytes(32))


class Timed:
    """Stores and loads that check every hit's bytes and the time of every call."""

    def __init__(self, tier: MooncakeTier, n: int = N):
        self.tier, self.n = tier, n
        self.slowest = 0.0

    def _timed(self, fn):
        t0 = time.monotonic()
        out = fn()
        self.slowest = max(self.slowest, time.monotonic() - t0)
        assert self.slowest < CALL_BOUND_S, f"a call took {self.slowest:.2f} s"
        return out

    def store(self, ids):
        items = [(key(i), payload(key(i), self.n)) for i in ids]
        return self._timed(lambda: self.tier.submit_store(items).result(timeout=30))

    def load(self, ids) -> list[bool]:
        outs = [np.full(self.n, 0xAA, np.uint8) for _ in ids]
        items = [(key(i), o) for i, o in zip(ids, outs, strict=True)]
        r = self._timed(lambda: self.tier.submit_load(items).result(timeout=30))
        for i, o, ok in zip(ids, outs, r.ok, strict=True):
            if ok:  # never a wrong byte
                np.testing.assert_array_equal(o, payload(key(i), self.n), err_msg=f"key {i}")
        return list(r.ok)

    def contains(self, ids) -> list[bool]:
        return self._timed(lambda: self.tier.contains([key(i) for i in ids]))


def until(what, timeout: float = 30.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while not (out := what()):
        assert time.monotonic() < deadline, "the store did not come back in time"
        time.sleep(every)
    return out


def test_master_killed_and_restarted():
    store = MooncakeStore()
    tier = open_tier(store)
    t = Timed(tier)
    try:
        assert t.store(range(8)).all_ok and t.load(range(8)) == [True] * 8
        store.kill_master()
        assert t.load(range(8)) == [False] * 8  # misses, within the bound
        assert t.contains(range(8)) == [False] * 8
        r = t.store(range(8, 12))
        assert not any(r.ok)  # failed or dropped, never an exception
        later = t.store(range(12, 16))  # the master is known down: dropped at once
        assert later.dropped and not tier.available()
        s = tier.stats()
        assert s.errors >= 1 and s.stores_dropped >= 1 and s.load_misses == 8
        store.start_master()  # same ports; it remembers nothing
        assert until(lambda: t.store([20]).all_ok), "stores resume once the master is back"
        assert t.load([20, *range(8)]) == [True] + [False] * 8  # the old entries are gone
        assert tier.available() and t.contains([20]) == [True]
    finally:
        tier.close()
        store.stop()


def test_a_storage_node_holding_entries_killed():
    # Two storage nodes; the master forgets a dead one's objects after --client_ttl.
    store = MooncakeStore(nodes=2, segment="64MB", master_flags=("--client_ttl=2",))
    tier = open_tier(store)
    t = Timed(tier)
    try:
        ids = range(48)
        assert t.store(ids).all_ok and t.load(ids) == [True] * 48
        store.kill_node(1)
        first = t.load(ids)  # those on the dead node miss (a failed transfer), no wait
        assert 0 < sum(first) < 48, "the entries should spread over both segments"
        s = tier.stats()
        assert s.errors >= 48 - sum(first) and s.corrupt == 0
        # Once the master has unmounted the dead segment, its keys are absent, and new
        # stores land on the live node.
        lost = [i for i, ok in zip(ids, first, strict=True) if not ok]
        until(lambda: not any(t.contains(lost)), timeout=20)
        assert t.load(ids) == first  # the survivors, byte for byte
        assert t.store(lost).all_ok and t.load(lost) == [True] * len(lost)
    finally:
        tier.close()
        store.stop()


def test_the_store_full_evicts_on_its_own():
    # One 32 MB segment; leases (a read object is not evicted for that long) short enough
    # that what was read may be evicted soon, long enough for a read on 2 busy cores.
    flags = ("--default_kv_lease_ttl=1000", "--eviction_high_watermark_ratio=0.8")
    store = MooncakeStore(segment="32MB", master_flags=flags)
    n = 1 << 20
    tier = open_tier(store)
    t = Timed(tier, n)
    try:
        stored = []
        for start in range(0, 160, 8):  # 160 MiB into 32 MB
            r = t.store(range(start, start + 8))
            stored += [i for i, ok in zip(range(start, start + 8), r.ok, strict=True) if ok]
            time.sleep(0.05)
        s = tier.stats()
        assert s.keys_stored == len(stored) and s.keys_stored + s.store_failures == 160
        assert len(stored) > 32, "eviction should make room for more than one segment's worth"
        hits = t.load(range(160))
        assert sum(hits) * n <= 32e6, "more entries than the segment holds"
        assert any(hits[-16:]) and not all(hits[:32]), "the old ones go first"
        assert tier.stats().corrupt == 0
        until(lambda: t.store([500]).all_ok, timeout=10)  # room again once leases end
        assert t.load([500]) == [True]
    finally:
        tier.close()
        store.stop()


def test_with_two_replicas_a_killed_node_costs_misses_only_until_the_master_notices():
    store = MooncakeStore(nodes=2, segment="64MB", master_flags=("--client_ttl=2",))
    tier = open_tier(store, replica_num=2)
    t = Timed(tier)
    try:
        ids = range(32)
        assert t.store(ids).all_ok
        store.kill_node(1)
        t.load(ids)  # a key whose chosen replica was on the dead node misses at first
        # Once the master has unmounted the dead segment, every key's other copy serves.
        until(lambda: all(t.load(ids)), timeout=20)
        assert tier.stats().corrupt == 0
    finally:
        tier.close()
        store.stop()
