"""RedisTier on a real Redis Cluster that misbehaves: a primary killed (its replica
takes over), a primary paused (SIGSTOP), a resharding under load (`redis-cli --cluster
reshard`), the whole cluster down and back. Checked each time: misses and counted
failures or drops, every call within the documented bounds (`io_timeout_s` per node
that does not answer, `connect_timeout_s` to connect), no exception, no wrong byte
(every hit is compared with the stored payload), and the tier back once the cluster is.
"""

from __future__ import annotations

import subprocess
import threading
import time

import numpy as np
import pytest

from jax_kvoffload.tiers import RedisTier, RedisTierConfig
from jax_kvoffload.tiers._redis_cluster import REFRESH_INTERVAL_S
from jax_kvoffload.tiers._slots import key_slot

from ._cluster import HAVE_CLUSTER, NO_CLUSTER, REDIS_CLI, RedisCluster
from ._helpers import key, payload

pytestmark = pytest.mark.skipif(not HAVE_CLUSTER, reason=NO_CLUSTER)

NS = bytes(range(32))
N = 4096
IO_TIMEOUT_S = 0.5
CALL_BOUND_S = 3 * IO_TIMEOUT_S + 1.5  # a call waits for at most a few silent batches


def open_tier(url, **kw):
    kw = {"io_timeout_s": IO_TIMEOUT_S, "connect_timeout_s": 0.3, "retry_after_s": 0.2, **kw}
    return RedisTier(RedisTierConfig(url=url, **kw), NS)


class Timed:
    """Stores and loads that check every hit's bytes and the time of every call."""

    def __init__(self, tier):
        self.tier = tier
        self.slowest = 0.0

    def _timed(self, fn):
        t0 = time.monotonic()
        out = fn()
        self.slowest = max(self.slowest, time.monotonic() - t0)
        assert self.slowest < CALL_BOUND_S, f"a call took {self.slowest:.2f} s"
        return out

    def store(self, ids):
        items = [(key(i), payload(key(i), N)) for i in ids]
        return self._timed(lambda: self.tier.submit_store(items).result(timeout=30))

    def load(self, ids):
        outs = [np.full(N, 0xAA, np.uint8) for _ in ids]
        items = [(key(i), o) for i, o in zip(ids, outs)]
        r = self._timed(lambda: self.tier.submit_load(items).result(timeout=30))
        for i, o, ok in zip(ids, outs, r.ok):
            if ok:  # never a wrong byte
                np.testing.assert_array_equal(o, payload(key(i), N))
        return list(r.ok)

    def contains(self, ids):
        return self._timed(lambda: self.tier.contains([key(i) for i in ids]))


def shard_of(cluster, tier, ids):
    return [cluster.owner(key_slot(tier.key_of(key(i)))) for i in ids]


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout:g} s"
        time.sleep(0.1)
    return time.monotonic()


def test_a_killed_primary_fails_over_to_its_replica():
    cluster = RedisCluster(3, 1, node_timeout_ms=1000, full_coverage=False)
    try:
        tier = open_tier(cluster.url)
        t = Timed(tier)
        ids = list(range(60))
        assert t.store(ids).all_ok
        for port in cluster.primaries():  # the replicas hold every key before the kill
            assert cluster.nodes[port].call(b"WAIT", b"1", b"5000") == 1
        owners = shard_of(cluster, tier, ids)
        victim = owners[0]
        on_victim = [o == victim for o in owners]
        cluster.nodes[victim].kill()
        killed = time.monotonic()
        # The other shards serve on; the dead one's keys miss and its stores fail, fast.
        assert t.load(ids) == [not v for v in on_victim]
        r = t.store(range(100, 130))
        assert not r.dropped and 0 < sum(r.ok) < 30
        assert t.contains(ids) == [not v for v in on_victim]
        assert f"127.0.0.1:{victim}" in tier.topology().down
        # The replica is promoted; the tier finds it and serves every key again.
        back = wait_for(lambda: all(t.load(ids)), 30, "the tier serves every key again")
        print(f"failover cost: {back - killed:.1f} s with cluster-node-timeout 1 s")
        assert victim not in cluster.primaries()
        assert f"127.0.0.1:{victim}" not in tier.topology().slots
        assert t.store(range(200, 230)).all_ok
        s = tier.stats()
        assert s.corrupt == 0 and s.store_failures >= 1 and s.load_misses >= 1
        tier.close()
    finally:
        cluster.stop()


def test_a_paused_primary_costs_at_most_the_timeout_then_serves_again(redis_cluster):
    cluster = redis_cluster
    cluster.flush()
    tier = open_tier(cluster.url)
    t = Timed(tier)
    try:
        ids = list(range(40))
        assert t.store(ids).all_ok
        victim = shard_of(cluster, tier, ids)[0]
        on_victim = [o == victim for o in shard_of(cluster, tier, ids)]
        cluster.nodes[victim].pause()  # SIGSTOP: connections stay open, nothing answers
        try:
            t0 = time.monotonic()
            assert t.load(ids) == [not v for v in on_victim]
            assert t.load(ids) == [not v for v in on_victim]  # down now: no wait at all
            r = t.store(range(100, 120))
            assert not r.dropped and not r.all_ok
            assert t.contains(ids) == [not v for v in on_victim]
            assert time.monotonic() - t0 < IO_TIMEOUT_S + CALL_BOUND_S
        finally:
            cluster.nodes[victim].resume()
        wait_for(lambda: all(t.load(ids)), 10, "the paused node serves again")
        assert tier.stats().corrupt == 0
    finally:
        tier.close()
        cluster.wait_ok()


def test_the_whole_cluster_down_drops_stores_and_comes_back():
    cluster = RedisCluster(3, node_timeout_ms=1000)
    try:
        tier = open_tier(cluster.url)
        t = Timed(tier)
        assert t.store(range(20)).all_ok
        for node in cluster.nodes.values():
            node.kill()
        t0 = time.monotonic()
        first = t.store(range(20, 30))  # finds every primary gone
        assert not first.all_ok
        assert t.load(list(range(20))) == [False] * 20
        assert t.contains(range(20)) == [False] * 20
        assert not tier.available()
        assert t.store(range(30, 40)).dropped  # refused at submission: nothing queued
        assert time.monotonic() - t0 < CALL_BOUND_S
        s = tier.stats()
        assert s.stores_dropped >= 1 and s.keys_dropped >= 10
        for node in cluster.nodes.values():
            node.start()  # same ports, same nodes.conf: the same cluster, empty
        cluster.wait_ok()
        wait_for(lambda: t.store(range(40, 50)).all_ok, 15, "stores succeed again")
        assert t.load(list(range(40, 50))) == [True] * 10
        assert t.load([0]) == [False]  # no persistence: a miss, not a wrong byte
        tier.close()
    finally:
        cluster.stop()


def node_id(cluster, port) -> bytes:
    return cluster.nodes[port].call(b"CLUSTER", b"MYID")


def reshard_under_load(cluster, slots: int) -> None:
    tier = open_tier(cluster.url, io_timeout_s=2.0, read_connections=2, write_connections=2)
    t = Timed(tier)
    stored: set[int] = set()
    errors: list[BaseException] = []
    stop = threading.Event()
    assert t.store(range(200)).all_ok
    stored.update(range(200))

    def writer(base):
        i = base
        try:
            while not stop.is_set():
                ids = list(range(i, i + 8))
                r = t.store(ids)
                stored.update(k for k, ok in zip(ids, r.ok) if ok)
                i += 8
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def reader():
        rng = np.random.default_rng(0)
        try:
            while not stop.is_set():
                t.load([int(i) for i in rng.choice(200, 16, replace=False)])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(10**6,)), threading.Thread(target=reader)]
    source, target = cluster.primaries()[:2]
    for th in threads:
        th.start()
    try:
        out = subprocess.run(
            [
                REDIS_CLI,
                "--cluster",
                "reshard",
                f"127.0.0.1:{source}",
                "--cluster-from",
                node_id(cluster, source).decode(),
                "--cluster-to",
                node_id(cluster, target).decode(),
                "--cluster-slots",
                str(slots),
                "--cluster-yes",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stdout[-2000:]
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert errors == []
    cluster.wait_ok()
    # Every store reported done is there, on the node that serves its slot now.
    ids = sorted(stored)
    assert t.load(ids) == [True] * len(ids)
    # Redirects patched the slots they named; the next map read has every move.
    time.sleep(REFRESH_INTERVAL_S)
    assert t.load(ids[:8]) == [True] * 8
    counts = sorted(tier.topology().slots.values())
    assert counts == sorted(cluster_slot_counts(cluster))
    s = tier.stats()
    assert s.corrupt == 0 and s.errors == 0
    assert tier.topology().redirects > 0  # the resharding was seen, not avoided
    tier.close()


def cluster_slot_counts(cluster) -> list[int]:
    counts: dict[int, int] = {}
    node = cluster.nodes[cluster.primaries()[0]]
    for first, last, primary, *_ in node.call(b"CLUSTER", b"SLOTS"):
        counts[int(primary[1])] = counts.get(int(primary[1]), 0) + last - first + 1
    return list(counts.values())


@pytest.mark.parametrize("slots", [300, pytest.param(3000, marks=pytest.mark.slow)])
def test_a_resharding_under_load_loses_no_store_and_serves_no_wrong_byte(slots):
    cluster = RedisCluster(3)
    try:
        reshard_under_load(cluster, slots)
    finally:
        cluster.stop()
