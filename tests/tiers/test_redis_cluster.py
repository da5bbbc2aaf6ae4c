"""RedisTier on a real 3-primary Redis Cluster (loopback, the session's `redis_cluster`):
found from any one node, keys spread by hash slot, one value per chunk as on one
server, seed nodes, a slot migrating under the tier (ASK, then MOVED), damaged values,
another process, and `cluster="off"` against a cluster."""

from __future__ import annotations

import contextlib
import shutil

import pytest

from jax_kvoffload.tiers._slots import key_slot

from ._cluster import HAVE_CLUSTER, NO_CLUSTER, RedisCluster
from ._contract import CHECKS
from ._contract_harnesses import RedisHarness
from ._helpers import free_port, key, run_child
from .test_redis import load, make_certs, open_redis, store
from .test_redis import test_concurrent_writers_and_readers as concurrent_writers_and_readers

pytestmark = pytest.mark.skipif(not HAVE_CLUSTER, reason=NO_CLUSTER)

NS = bytes(range(32))
N = 8192


@pytest.fixture
def cluster(redis_cluster):
    redis_cluster.flush()
    return redis_cluster


def open_tier(url, **kw):
    return open_redis(url, **kw)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_any_node_finds_the_cluster_and_keys_spread_over_every_primary(cluster, which):
    tier = open_tier(f"redis://127.0.0.1:{cluster.ports[which]}/0")
    try:
        r = store(tier, range(60))
        assert r.all_ok and r.nbytes == 60 * N
        assert load(tier, list(range(62))) == [True] * 60 + [False] * 2
        assert tier.contains([key(0), key(99)]) == [True, False]
        held = cluster.keys()
        assert sorted(held) == sorted(cluster.primaries())
        assert all(len(ks) >= 10 for ks in held.values())  # ~20 each
        for port, ks in held.items():  # each key on the primary of its slot
            assert all(cluster.owner(key_slot(k)) == port for k in ks)
        k = tier.key_of(key(3))
        node = cluster.nodes[cluster.owner(key_slot(k))]
        assert node.call(b"STRLEN", k) == 68 + 36 + N  # header + payload, one value
        top = tier.topology()
        assert top.cluster and sorted(top.slots.values()) == [5461, 5461, 5462]
        s = tier.stats()
        assert (s.keys_stored, s.load_hits, s.load_misses, s.corrupt, s.errors) == (60, 60, 2, 0, 0)
    finally:
        tier.close()


def test_cluster_on_reads_the_map_first_and_seeds_stand_in_for_a_dead_url(cluster):
    dead = f"redis://127.0.0.1:{free_port()}/0"
    seeds = [f"redis://127.0.0.1:{p}" for p in cluster.ports[1:]]
    tier = open_tier(dead, seed_urls=seeds, connect_timeout_s=0.5)
    try:
        assert tier.config.cluster == "on"
        assert store(tier, range(30)).all_ok  # the url's node is down: a seed answered
        assert load(tier, list(range(30))) == [True] * 30
        top = tier.topology()
        assert top.redirects == 0 and top.map_refreshes >= 1  # routed right at once
    finally:
        tier.close()


def test_a_standalone_config_against_a_cluster_fails_only_the_other_nodes_keys(cluster):
    tier = open_tier(cluster.url, cluster="off")
    try:
        r = store(tier, range(30))
        mine = [cluster.owner(key_slot(tier.key_of(key(i)))) == cluster.ports[0] for i in range(30)]
        assert list(r.ok) == mine and 0 < sum(mine) < 30  # the others: refused (MOVED)
        assert load(tier, list(range(30))) == mine
        assert not tier.topology().cluster
    finally:
        tier.close()


def test_a_damaged_value_is_a_miss_and_is_removed_on_its_node(cluster):
    tier = open_tier(cluster.url)
    try:
        store(tier, range(12))
        victims = [2, 7]
        for i in victims:
            k = tier.key_of(key(i))
            cluster.nodes[cluster.owner(key_slot(k))].call(b"SETRANGE", k, b"300", b"\x00\xff")
        assert load(tier, list(range(12))) == [i not in victims for i in range(12)]
        for i in victims:
            k = tier.key_of(key(i))
            assert cluster.nodes[cluster.owner(key_slot(k))].call(b"EXISTS", k) == 0
        assert tier.stats().corrupt == 2
    finally:
        tier.close()


def test_another_process_reads_what_this_one_stored(cluster):
    tier = open_tier(cluster.url)
    try:
        assert store(tier, [1, 2, 3]).all_ok
        code = (
            "import sys, numpy as np\n"
            "from tests.tiers._helpers import key, payload\n"
            "from jax_kvoffload.tiers import RedisTier, RedisTierConfig\n"
            "t = RedisTier(RedisTierConfig(url=sys.argv[1]), bytes(range(32)))\n"
            "outs = [np.zeros(8192, np.uint8) for _ in range(3)]\n"
            "r = t.submit_load([(key(i + 1), o) for i, o in enumerate(outs)]).result()\n"
            "assert r.all_ok and all((o == payload(key(i + 1), 8192)).all()\n"
            "                        for i, o in enumerate(outs))\n"
            "t.close()\n"
        )
        other = f"redis://127.0.0.1:{cluster.ports[2]}/0"
        out = run_child(code, other)
        assert out.returncode == 0, out.stderr
    finally:
        tier.close()


def migrate_slot(cluster, slot: int, source: int, target: int, between=None) -> None:
    """Moves `slot` from primary `source` to `target` as `redis-cli --cluster reshard`
    does: IMPORTING / MIGRATING, MIGRATE of each key, then SETSLOT NODE everywhere.
    `between()` runs while the slot is half moved."""
    src, dst = cluster.nodes[source], cluster.nodes[target]
    src_id, dst_id = src.call(b"CLUSTER", b"MYID"), dst.call(b"CLUSTER", b"MYID")
    dst.call(b"CLUSTER", b"SETSLOT", b"%d" % slot, b"IMPORTING", src_id)
    src.call(b"CLUSTER", b"SETSLOT", b"%d" % slot, b"MIGRATING", dst_id)
    ks = src.call(b"CLUSTER", b"GETKEYSINSLOT", b"%d" % slot, b"1000")
    for k in ks[: len(ks) // 2]:
        src.call(b"MIGRATE", b"127.0.0.1", b"%d" % target, k, b"0", b"5000")
    if between is not None:
        between()
    for k in src.call(b"CLUSTER", b"GETKEYSINSLOT", b"%d" % slot, b"1000"):
        src.call(b"MIGRATE", b"127.0.0.1", b"%d" % target, k, b"0", b"5000")
    for port in cluster.primaries():
        cluster.nodes[port].call(b"CLUSTER", b"SETSLOT", b"%d" % slot, b"NODE", dst_id)


def test_a_slot_migrating_under_the_tier_asks_then_moves(cluster):
    tier = open_tier(cluster.url)
    try:
        # Keys of one slot: a hash tag in the prefix puts them all there.
        tagged = open_tier(cluster.url, key_prefix="jkv{mig}")
        slot = key_slot(b"mig")
        source = cluster.owner(slot)
        target = next(p for p in cluster.primaries() if p != source)
        assert store(tagged, range(10)).all_ok
        seen = {}

        def half_moved():
            # Keys already on the target are asked for there (ASK); new keys too.
            seen["loads"] = load(tagged, list(range(10)))
            seen["store"] = store(tagged, range(10, 14)).all_ok
            seen["redirects"] = tagged.topology().redirects

        migrate_slot(cluster, slot, source, target, half_moved)
        assert seen == {"loads": [True] * 10, "store": True, "redirects": seen["redirects"]}
        assert seen["redirects"] >= 5  # ASK for the keys that had moved, and the new ones
        assert load(tagged, list(range(14))) == [True] * 14  # MOVED once, then the new map
        assert cluster.owner(slot) == target
        assert all(cluster.owner(key_slot(k)) == target for k in cluster.keys()[target])
        assert tagged.stats().corrupt == 0
        # Put it back, so the session's cluster is as it was.
        migrate_slot(cluster, slot, target, source)
        assert load(tagged, list(range(14))) == [True] * 14
        tagged.close()
        assert store(tier, range(5)).all_ok
    finally:
        tier.close()
        cluster.wait_ok()


def test_many_threads_at_once(cluster):
    tier = open_tier(cluster.url, read_connections=3, write_connections=2)
    try:
        concurrent_writers_and_readers(tier)  # the standalone scenario, on the cluster
    finally:
        tier.close()


def test_a_cluster_with_a_password_and_a_tenant_acl_user(monkeypatch):
    cluster = RedisCluster(3, password="s3cret")
    try:
        no = open_tier(cluster.url, connect_timeout_s=0.5)
        try:
            assert store(no, [1]).ok == (False,)  # NOAUTH on every node: refused, no raise
        finally:
            no.close()
        monkeypatch.setenv("JKV_TEST_CLUSTER_PASSWORD", "s3cret")
        yes = open_tier(cluster.url, password_env="JKV_TEST_CLUSTER_PASSWORD")
        try:
            assert store(yes, range(20)).all_ok and load(yes, list(range(20))) == [True] * 20
        finally:
            yes.close()
        # A tenant limited to its prefix: a cluster also needs ASKING and the slot map.
        rules = [b"on", b">pw", b"~tenant-a:jkv:*", b"+get", b"+set", b"+exists", b"+del",
                 b"+ping", b"+asking", b"+cluster|shards", b"+cluster|slots"]  # fmt: skip
        for node in cluster.nodes.values():
            node.call(b"ACL", b"SETUSER", b"tenant-a", *rules)
        url = f"redis://tenant-a:pw@127.0.0.1:{cluster.ports[1]}/0"
        tenant = open_tier(url, key_prefix="tenant-a:jkv")
        outside = open_tier(url, key_prefix="tenant-b:jkv")
        try:
            assert store(tenant, range(20)).all_ok and load(tenant, list(range(20))) == [True] * 20
            assert tenant.topology().map_refreshes >= 1
            assert store(outside, [1]).ok == (False,)  # NOPERM for another prefix
        finally:
            tenant.close()
            outside.close()
    finally:
        cluster.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_a_tls_cluster(tmp_path):
    certs = make_certs(tmp_path)
    try:
        cluster = RedisCluster(3, tls=certs)
    except RuntimeError as e:  # a redis-server built without TLS
        pytest.skip(f"redis-server cannot serve a TLS cluster here: {e}")
    try:
        # The url names localhost; the nodes announce 127.0.0.1: each is verified by its
        # own address (the certificate holds both).
        url = f"rediss://localhost:{cluster.ports[0]}/0"
        tier = open_tier(url, tls_ca_file=certs["ca.pem"])
        untrusted = open_tier(url, connect_timeout_s=1.0)
        try:
            big = 1 << 20
            assert store(tier, range(12), n=big).all_ok
            assert load(tier, list(range(12)), n=big) == [True] * 12
            assert len(tier.topology().slots) == 3
            assert sum(len(ks) for ks in cluster.keys().values()) == 12
            assert store(untrusted, [1]).ok == (False,)
        finally:
            tier.close()
            untrusted.close()
    finally:
        cluster.stop()


class ClusterHarness(RedisHarness):
    """The contract suite's Redis harness on the session's cluster: the tier is given
    one node's URL; damage rewrites the value on the node that holds it; a stall pauses
    writes on every primary."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster

    def start(self, tmp_path: str) -> None:
        self.cluster.flush()

    def stop(self) -> None:
        self.cluster.wait_ok()

    def options(self) -> dict:
        return {"url": self.cluster.url, "io_timeout_s": 5.0, "read_connections": 2}

    def _node(self, tier, key: bytes):
        return self.cluster.nodes[self.cluster.owner(key_slot(tier.key_of(key)))]

    def damage(self, tier, key: bytes) -> None:
        self.server = self._node(tier, key)
        super().damage(tier, key)

    @contextlib.contextmanager
    def stalled_stores(self, tier):
        primaries = [self.cluster.nodes[p] for p in self.cluster.primaries()]
        for node in primaries:
            assert node.call(b"CLIENT", b"PAUSE", b"4000", b"WRITE") == "OK"
        try:
            yield
        finally:
            for node in primaries:
                node.call(b"CLIENT", b"UNPAUSE")


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_the_tier_contract_holds_on_a_cluster(redis_cluster, check, tmp_path):
    harness = ClusterHarness(redis_cluster)
    harness.start(str(tmp_path))
    try:
        check(harness)
    finally:
        harness.stop()
