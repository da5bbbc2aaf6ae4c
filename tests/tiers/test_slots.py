"""Hash slots and slot maps (`tiers/_slots.py`): the CRC16 of the Redis Cluster
specification, hash tags, redirect replies, and `CLUSTER SHARDS` / `CLUSTER SLOTS`
replies checked before they are believed."""

from __future__ import annotations

import random

import pytest

from jax_kvoffload.tiers._slots import (
    SLOTS,
    SlotMap,
    SlotMapError,
    address_problem,
    key_slot,
    parse_redirect,
    parse_shards,
    parse_slots,
)

from ._cluster import HAVE_CLUSTER, NO_CLUSTER

A, B, C = ("127.0.0.1", 7001), ("127.0.0.1", 7002), ("127.0.0.1", 7003)


def test_key_slot_matches_the_specification():
    # Values of the Redis Cluster specification and of CLUSTER KEYSLOT.
    assert key_slot(b"123456789") == 0x31C3 & (SLOTS - 1)
    assert key_slot(b"foo") == 12182
    assert key_slot(b"hello") == 866
    # Hash tags: the first {...} with something inside; else the whole key.
    assert key_slot(b"{user1000}.following") == key_slot(b"user1000")
    assert key_slot(b"foo{}{bar}") == key_slot(b"foo{}{bar}")  # empty first tag: whole key
    assert key_slot(b"foo{{bar}}zap") == key_slot(b"{bar")
    assert key_slot(b"foo{bar}{zap}") == key_slot(b"bar")
    assert key_slot(b"{") == key_slot(b"{")  # no closing brace: the whole key


@pytest.mark.skipif(not HAVE_CLUSTER, reason=NO_CLUSTER)
def test_key_slot_agrees_with_a_real_cluster_node(redis_cluster):
    rng = random.Random(0)
    node = redis_cluster.nodes[redis_cluster.ports[0]]
    alphabet = b"ab{}:\x00\xff"
    for _ in range(200):
        k = bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        assert key_slot(k) == node.call(b"CLUSTER", b"KEYSLOT", k), k


def test_parse_redirect():
    r = parse_redirect("MOVED 3999 127.0.0.1:6381")
    assert (r.kind, r.slot, r.host, r.port) == ("MOVED", 3999, "127.0.0.1", 6381)
    r = parse_redirect("ASK 1 :7000")
    assert (r.kind, r.slot, r.host, r.port) == ("ASK", 1, None, 7000)  # same host
    assert parse_redirect("MOVED 2 [::1]:7000").host == "::1"
    for text in [
        "MOVED 16384 h:1",  # no such slot
        "MOVED 1 h:0",  # no such port
        "MOVED 1 h:65536",
        "MOVED x h:1",
        "MOVED 1 h",
        "MOVED 1 h:1 extra",
        "ERR unknown command",
        "ASK -1 h:1",
    ]:
        assert parse_redirect(text) is None, text


def test_address_rules():
    assert address_problem("127.0.0.1", 7000, loopback_only=True) is None
    assert address_problem("localhost", 7000, loopback_only=True) is None
    assert address_problem("10.0.0.5", 7000, loopback_only=False) is None
    assert address_problem("cache-3.internal", 7000, loopback_only=False) is None
    assert "not on loopback" in address_problem("10.0.0.5", 7000, loopback_only=True)
    assert "not on loopback" in address_problem("evil.example", 7000, loopback_only=True)
    for host in ["0.0.0.0", "::", "224.0.0.1", "a b", "-x", "é.example", "x" * 300, ""]:
        assert address_problem(host, 7000, loopback_only=False) is not None, host
    assert "port" in address_problem("10.0.0.5", 0, loopback_only=False)


def node(port, role=b"master", health=b"online", ip=b"127.0.0.1", **more):
    out = [b"id", b"x" * 40, b"port", port, b"ip", ip, b"endpoint", ip, b"role", role]
    out += [b"health", health]
    for k, v in more.items():
        out += [k.replace("_", "-").encode(), v]
    return out


def shard(slots, *nodes):
    return [b"slots", list(slots), b"nodes", list(nodes)]


def parse(reply, loopback_only=True, tls=False):
    return parse_shards(reply, "127.0.0.1", tls=tls, loopback_only=loopback_only)


def test_cluster_shards_map():
    reply = [
        shard([0, 5460], node(7001), node(7004, role=b"replica")),
        shard([5461, 10922], node(7002)),
        shard([10923, 16000, 16001, 16383], node(7003)),
    ]
    m = parse(reply)
    assert m.nodes == (A, B, C) and m.replicas == (("127.0.0.1", 7004),)
    assert m.node_of(0) == A and m.node_of(5461) == B and m.node_of(16383) == C
    assert m.slot_counts() == {A: 5461, B: 5462, C: 5461}
    # TLS: the tls-port where a node lists one.
    tls = parse([shard([0, 16383], node(7001, tls_port=8001))], tls=True)
    assert tls.nodes == (("127.0.0.1", 8001),)
    # A NULL / empty endpoint: the host the map came from; "?": unknown (not used).
    m = parse([shard([0, 99], node(7001, ip=b"")), shard([100, 16383], node(7002, ip=b"?"))])
    assert m.nodes == (A,) and m.node_of(100) is None
    # A failed primary listed before the online one: the online one serves.
    m = parse([shard([0, 16383], node(7009, health=b"fail"), node(7001))])
    assert m.nodes == (A,) and ("127.0.0.1", 7009) in m.replicas


def test_cluster_slots_map():
    reply = [
        [0, 5460, [b"127.0.0.1", 7001, b"id", []], [b"127.0.0.1", 7004, b"id", []]],
        [5461, 16383, [None, 7002, b"id"]],
    ]
    m = parse_slots(reply, "127.0.0.1", loopback_only=True)
    assert m.nodes == (A, B) and m.replicas == (("127.0.0.1", 7004),)
    assert m.node_of(16383) == B


@pytest.mark.parametrize(
    "reply, why",
    [
        (b"junk", "not a list"),
        ([b"slots"], "name/value"),
        ([[b"slots", [0], b"nodes", [node(7001)]]], "slot ranges"),
        ([shard([0, 16384], node(7001))], "0..16383"),
        ([shard([5, 4], node(7001))], "5..16383"),
        ([shard([0, 10], node(7001)), shard([10, 20], node(7002))], "two primaries"),
        ([shard([0, 10], node(0))], "1..65535"),
        ([shard([0, 10], node(7001, ip=b"10.1.2.3"))], "not on loopback"),
        ([shard([0, 10], node(7001, ip=b"\xff\xfe"))], "ASCII"),
        ([shard([0, 10], node(b"7001"))], "integer"),
        ([], "no slot"),
        ([shard([0, 10], node(7001, role=b"replica"))], "no slot"),
    ],
)
def test_a_bad_cluster_shards_reply_is_refused_whole(reply, why):
    with pytest.raises(SlotMapError, match=why):
        parse(reply)


@pytest.mark.parametrize(
    "reply, why",
    [
        ({}, "not a list"),
        ([[0, 10]], "first, last, primary"),
        ([[0, 10, [b"127.0.0.1"]]], "endpoint, port"),
        ([[0, 10, [b"127.0.0.1", 7001]], [5, 20, [b"127.0.0.1", 7002]]], "two primaries"),
        ([[0, 10, [b"8.8.8.8", 7001]]], "not on loopback"),
    ],
)
def test_a_bad_cluster_slots_reply_is_refused_whole(reply, why):
    with pytest.raises(SlotMapError, match=why):
        parse_slots(reply, "127.0.0.1", loopback_only=True)


def test_moved_patches_a_copy():
    m = SlotMap.single(A)
    moved = m.moved({5: B, 6: B, 7: C})
    assert m.node_of(5) == A  # unchanged
    assert moved.node_of(5) == B and moved.node_of(7) == C and moved.node_of(8) == A
    assert moved.slot_counts() == {A: SLOTS - 3, B: 2, C: 1}
