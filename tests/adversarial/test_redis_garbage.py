"""A Redis-protocol server that answers garbage: the tier's caller never sees an
exception, and a connection that lost sync is never used again (a stale reply read as
the answer to a later command would turn a refused store into a success, or an absent
key into a hit). No real server needed: `_fake_resp.FakeResp` scripts the answers."""

from __future__ import annotations

import time

import numpy as np
import pytest

from jax_kvoffload.tiers import RedisTier, RedisTierConfig

from ._fake_resp import FakeResp

NS = bytes(range(32))
K1, K2 = b"\x01" * 32 + bytes(4), b"\x02" * 32 + bytes(4)

GARBAGE = {
    "integer": b":abc\r\n",
    "bulk length": b"$1x\r\n",
    "huge bulk": b"$99999999999999\r\n",
    "deep arrays": b"*1\r\n" * 5000 + b":1\r\n",
    "array length": b"*x\r\n",
    "status not utf-8": b"+\xff\xfe\r\n",
}


def tier(url: str) -> RedisTier:
    return RedisTier(
        RedisTierConfig(
            url=url, io_timeout_s=2.0, retry_after_s=0.01, read_connections=1, write_connections=1
        ),
        NS,
    )


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_contains_answers_false_on_garbage_and_drops_the_connection(kind):
    # The first EXISTS gets garbage followed by a stale ":1"; every later one ":0".
    # Before the fix: ValueError / MemoryError / RecursionError / UnicodeDecodeError
    # from contains(), and the connection (holding the stale ":1") went back to the pool.
    def reply(conn, args):
        first = conn == 0 and len(server.commands) == 1
        return GARBAGE[kind] + b":1\r\n" if first else b":0\r\n"

    with FakeResp(reply) as server:
        t = tier(server.url)
        try:
            assert t.contains([K1]) == [False]
            time.sleep(0.05)  # past retry_after_s: the server is tried again
            assert t.contains([K2]) == [False]  # not the stale ":1"
            assert server.connections == 2
        finally:
            t.close()


@pytest.mark.parametrize("kind", ["bulk length", "integer", "status not utf-8"])
def test_a_refused_store_after_garbage_is_not_reported_stored(kind):
    # First SET: garbage then a stale "+OK"; second SET (any connection): refused.
    # Before the fix the store thread kept the connection and read the stale "+OK" as
    # the second SET's answer: a store the server refused was reported stored.
    def reply(conn, args):
        if len(server.commands) == 1:
            return GARBAGE[kind] + b"+OK\r\n"
        return b"-ERR refused\r\n"

    with FakeResp(reply) as server:
        t = tier(server.url)
        try:
            row = np.arange(64, dtype=np.uint8)
            first = t.submit_store([(K1, row)]).result(10)
            assert first.ok == (False,)
            time.sleep(0.05)  # past retry_after_s: the next store is not dropped
            second = t.submit_store([(K2, row)]).result(10)
            assert second.ok == (False,) and not second.dropped
            assert t.stats().keys_stored == 0
        finally:
            t.close()


def test_a_load_after_garbage_reads_its_own_reply():
    # First GET: garbage and a stale valid-looking nil; later GETs: a huge bogus length.
    # Every load misses, within the timeout, and nothing raises.
    def reply(conn, args):
        return b"$1x\r\n$-1\r\n" if len(server.commands) == 1 else b"$-1\r\n"

    with FakeResp(reply) as server:
        t = tier(server.url)
        try:
            out = np.zeros(64, np.uint8)
            assert t.submit_load([(K1, out)]).result(10).ok == (False,)
            assert t.submit_load([(K2, out)]).result(10).ok == (False,)
        finally:
            t.close()
