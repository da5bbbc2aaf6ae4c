"""Hostile and broken cluster nodes (scripted by `_fake_resp.FakeNode`): garbage slot
maps, redirects to nowhere, to other machines or in a loop, CLUSTERDOWN. The caller
never sees an exception or a wrong byte, every wait is bounded, redirects end after
`MAX_ROUNDS` sends of a key and slot maps are read at most every REFRESH_INTERVAL_S."""

from __future__ import annotations

import logging
import time

import pytest

from jax_kvoffload.tiers import RedisTier, RedisTierConfig
from jax_kvoffload.tiers._redis_cluster import REFRESH_INTERVAL_S
from jax_kvoffload.tiers._redis_exchange import MAX_ROUNDS
from jax_kvoffload.tiers._slots import key_slot
from tests.tiers._helpers import free_port, key
from tests.tiers.test_redis import load as redis_load
from tests.tiers.test_redis import store as redis_store

from ._fake_resp import Err, FakeNode, resp, shards

NS = bytes(range(32))
N = 512
DATA = (b"SET", b"GET", b"EXISTS")


def tier(node, **kw) -> RedisTier:
    kw = {"io_timeout_s": 1.0, "connect_timeout_s": 0.5, "retry_after_s": 0.05,
          "read_connections": 1, "write_connections": 1, **kw}  # fmt: skip
    return RedisTier(RedisTierConfig(url=node.url, **kw), NS)


def store(t, ids):
    return redis_store(t, ids, n=N)


def load(t, ids):
    return redis_load(t, ids, n=N)


def moved(slot_of_key, port, host="127.0.0.1"):
    return resp(Err(f"MOVED {slot_of_key} {host}:{port}"))


def split_nodes():
    """Two nodes: A serves slots 0..8191, B the rest, each redirecting the other's keys
    and answering CLUSTER SHARDS with that map."""
    a, b = FakeNode(), FakeNode()
    table = shards((0, 8191, a.port), (8192, 16383, b.port))

    def hook_for(low: bool):
        def hook(conn, args):
            if args[:2] == [b"CLUSTER", b"SHARDS"]:
                return table
            if args[0] in DATA:
                slot = key_slot(args[1])
                if (slot < 8192) != low:
                    return moved(slot, (b if low else a).port)
            return None

        return hook

    a.hook, b.hook = hook_for(True), hook_for(False)
    return a, b


def test_a_cluster_is_found_from_one_node_and_keys_spread_by_slot():
    a, b = split_nodes()
    with a, b:
        t = tier(a)
        try:
            assert store(t, range(40)).all_ok
            assert load(t, list(range(40))) == [True] * 40
            assert t.contains([key(i) for i in range(42)]) == [True] * 40 + [False] * 2
            assert all(key_slot(k) < 8192 for k in a.data)
            assert all(key_slot(k) >= 8192 for k in b.data)
            assert len(a.data) + len(b.data) == 40 and a.data and b.data
            top = t.topology()
            assert top.cluster and top.slots == {
                f"127.0.0.1:{a.port}": 8192,
                f"127.0.0.1:{b.port}": 8192,
            }
            assert top.map_refreshes >= 1
            # Once the map is known, no key is sent to the wrong node again.
            before = len(a.commands) + len(b.commands)
            assert load(t, list(range(40))) == [True] * 40
            assert len(a.commands) + len(b.commands) - before == 40
        finally:
            t.close()


def test_ask_sends_asking_first_and_leaves_the_map_alone():
    a, b = FakeNode(), FakeNode()
    target = key(3)
    with a, b:
        t = tier(a)
        rtarget = t.key_of(target)
        a.hook = lambda conn, args: (
            resp(Err(f"ASK {key_slot(rtarget)} 127.0.0.1:{b.port}"))
            if args[0] in DATA and args[1] == rtarget
            else None
        )
        try:
            assert store(t, [1, 3, 5]).all_ok
            assert list(b.data) == [rtarget] and b.asked[0][:2] == [b"SET", rtarget]
            assert load(t, [1, 3, 5]) == [True] * 3
            assert t.topology().slots == {f"127.0.0.1:{a.port}": 16384}  # not MOVED
        finally:
            t.close()


def test_a_redirect_loop_ends_after_max_rounds():
    a, b = FakeNode(), FakeNode()
    with a, b:
        a.hook = lambda c, args: moved(key_slot(args[1]), b.port) if args[0] in DATA else None
        b.hook = lambda c, args: moved(key_slot(args[1]), a.port) if args[0] in DATA else None
        t = tier(a)
        try:
            t0 = time.monotonic()
            r = store(t, [1])
            assert r.ok == (False,) and not r.dropped
            assert load(t, [1]) == [False]
            assert t.contains([key(1)]) == [False]
            assert time.monotonic() - t0 < 5
            sets = a.count(b"SET") + b.count(b"SET")
            assert sets == MAX_ROUNDS  # one key, sent MAX_ROUNDS times, then given up
            assert t.stats().store_failures == 1
        finally:
            t.close()


def test_moved_to_nowhere_fails_fast():
    nowhere = free_port()
    a = FakeNode(lambda c, args: moved(key_slot(args[1]), nowhere) if args[0] in DATA else None)
    with a:
        t = tier(a)
        try:
            t0 = time.monotonic()
            assert store(t, [1, 2]).ok == (False, False)
            assert load(t, [1, 2]) == [False, False]
            assert time.monotonic() - t0 < 3
            assert f"127.0.0.1:{nowhere}" in t.topology().down
        finally:
            t.close()


def test_moved_with_an_empty_host_means_the_same_host():
    b = FakeNode()
    a = FakeNode(lambda c, args: resp(Err(f"MOVED {key_slot(args[1])} :{b.port}"))
                 if args[0] in DATA else None)  # fmt: skip
    with a, b:
        t = tier(a)
        try:
            assert store(t, [1]).all_ok and len(b.data) == 1
        finally:
            t.close()


@pytest.mark.parametrize("host", ["10.9.8.7", "evil.example", "0.0.0.0"])
def test_a_loopback_cluster_never_sends_keys_to_another_machine(host, caplog):
    a = FakeNode(lambda c, args: (
        moved(key_slot(args[1]), 7000, host) if args[0] in DATA
        else shards((0, 16383, 7000), host=host.encode()) if args[0] == b"CLUSTER"
        else None
    ))  # fmt: skip
    with a, caplog.at_level(logging.DEBUG):  # logged at WARNING once per process
        t = tier(a)
        try:
            t0 = time.monotonic()
            assert store(t, [1]).ok == (False,)
            assert load(t, [1]) == [False]
            assert time.monotonic() - t0 < 2  # no connection attempt to it
            assert t.topology().slots == {f"127.0.0.1:{a.port}": 16384}
        finally:
            t.close()
    assert any("not followed" in r.getMessage() for r in caplog.records)


GARBAGE_MAPS = {
    "not RESP": b"%%%\r\n",
    "a string": resp(b"slots"),
    "odd pairs": resp([[b"slots", [0, 16383], b"nodes"]]),
    "overlap": shards((0, 9000, 1111), (8000, 16383, 2222)),
    "slot out of range": resp([[b"slots", [0, 20000], b"nodes", []]]),
    "huge array": b"*100000000\r\n",
    "deep": b"*1\r\n" * 50 + b":1\r\n",
    "no primary": resp([[b"slots", [0, 16383], b"nodes", [[b"port", 1, b"role", b"replica"]]]]),
    "bogus port": resp([[b"slots", [0, 16383], b"nodes", [[b"port", -5, b"role", b"master"]]]]),
}


@pytest.mark.parametrize("kind", sorted(GARBAGE_MAPS))
def test_a_garbage_slot_map_is_not_used_and_the_node_keeps_serving(kind):
    a = FakeNode(lambda c, args: GARBAGE_MAPS[kind] if args[0] == b"CLUSTER" else None)
    with a:
        t = tier(a, cluster="on")
        try:
            t0 = time.monotonic()
            assert store(t, range(6)).all_ok  # every key to the node asked: no map believed
            assert load(t, list(range(6))) == [True] * 6
            assert time.monotonic() - t0 < 5
            assert t.topology().map_refreshes == 0
        finally:
            t.close()


def test_cluster_slots_is_asked_where_cluster_shards_is_unknown():
    b = FakeNode()
    slots = None

    def hook(c, args):
        if args[:2] == [b"CLUSTER", b"SHARDS"]:
            return resp(Err("ERR unknown subcommand 'SHARDS'"))
        if args[:2] == [b"CLUSTER", b"SLOTS"]:
            return slots
        return None

    a = FakeNode(hook)
    with a, b:
        slots = resp([[0, 16383, [b"127.0.0.1", b.port, b"id"]]])
        t = tier(a, cluster="on")
        try:
            assert store(t, [1, 2]).all_ok and len(b.data) == 2 and not a.data
            assert t.topology().slots == {f"127.0.0.1:{b.port}": 16384}
        finally:
            t.close()


def test_slot_maps_are_read_at_a_bounded_rate_under_a_redirect_storm():
    a, b = FakeNode(), FakeNode()
    with a, b:
        table = shards((0, 16383, a.port))  # says A serves everything; A says otherwise
        a.hook = lambda c, args: (table if args[0] == b"CLUSTER"
                                  else moved(key_slot(args[1]), b.port) if args[0] in DATA
                                  else None)  # fmt: skip
        b.hook = lambda c, args: (table if args[0] == b"CLUSTER"
                                  else moved(key_slot(args[1]), a.port) if args[0] in DATA
                                  else None)  # fmt: skip
        t = tier(a)
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.5:
                store(t, [1, 2, 3])
                t.contains([key(4)])
            spent = time.monotonic() - t0
            maps = a.count(b"CLUSTER") + b.count(b"CLUSTER")
            assert 1 <= maps <= spent / REFRESH_INTERVAL_S + 2
        finally:
            t.close()


def test_clusterdown_is_a_miss_and_asks_for_the_map_again():
    a = FakeNode(lambda c, args: (
        resp(Err("CLUSTERDOWN The cluster is down")) if args[0] in DATA
        else shards((0, 16383, a.port)) if args[0] == b"CLUSTER"
        else None
    ))  # fmt: skip
    with a:
        t = tier(a, cluster="on")
        try:
            assert store(t, [1]).ok == (False,)
            assert load(t, [1]) == [False]
            time.sleep(REFRESH_INTERVAL_S + 0.1)
            assert load(t, [1]) == [False]
            assert a.count(b"CLUSTER") >= 2  # read again after a CLUSTERDOWN
        finally:
            t.close()


def test_cluster_off_never_follows_a_redirect():
    b = FakeNode()
    with b:
        a = FakeNode(lambda c, args: moved(key_slot(args[1]), b.port) if args[0] in DATA else None)
        with a:
            t = tier(a, cluster="off")
            try:
                assert store(t, [1]).ok == (False,)
                assert b.connections == 0 and not t.topology().cluster
            finally:
                t.close()


def test_a_slot_no_primary_serves_fails_without_a_connection():
    a = FakeNode()
    a.hook = lambda c, args: shards((0, 8191, a.port)) if args[0] == b"CLUSTER" else None
    with a:
        t = tier(a, cluster="on")
        try:
            ids = range(30)
            r = store(t, ids)
            served = [key_slot(t.key_of(key(i))) < 8192 for i in ids]
            assert list(r.ok) == served and 0 < sum(served) < 30
            assert load(t, list(ids)) == served
        finally:
            t.close()
