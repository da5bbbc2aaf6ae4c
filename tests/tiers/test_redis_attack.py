"""The Redis tier attacked: a load buffer of the wrong size (a caller's error: the value
stays), a host name whose lookup hangs (bounded by connect_timeout_s), a server killed
in the middle of a pipelined batch (misses, never a hang or a wrong byte)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from jax_kvoffload.errors import KVOffloadValueError
from jax_kvoffload.tiers import RedisTier, RedisTierConfig, TierBufferSizeError

from ._helpers import NO_REDIS, REDIS_SERVER, RedisServer, key, payload

NS = bytes(range(32))
N = 8192
needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason=NO_REDIS)


def open_redis(url, **kw):
    kw.setdefault("io_timeout_s", 2.0)
    return RedisTier(RedisTierConfig(url=url, **kw), NS)


def store(tier, ids, n=N):
    return tier.submit_store([(key(i), payload(key(i), n)) for i in ids]).result(timeout=30)


@needs_redis
@pytest.mark.parametrize("size", [N // 2, N - 1, N + 1, 3 * N, 4])
def test_a_load_into_a_buffer_of_the_wrong_size_raises_and_keeps_the_value(
    redis, redis_server, size
):
    # Before: the value, whole and checked, was DEL'd as corrupt (every engine sharing
    # the server lost it).
    assert store(redis, [1, 2, 3]).all_ok
    outs = [np.zeros(N, np.uint8), np.zeros(size, np.uint8), np.zeros(N, np.uint8)]
    future = redis.submit_load([(key(i), o) for i, o in zip((1, 2, 3), outs)])
    with pytest.raises(TierBufferSizeError) as err:
        future.result(timeout=30)
    assert isinstance(err.value, KVOffloadValueError)
    assert f"items[1] buffer has {size} bytes" in str(err.value)
    assert f"payload of {N} bytes" in str(err.value)
    assert err.value.result.ok == (True, False, True)  # the connection stayed in step
    for i in (0, 2):
        np.testing.assert_array_equal(outs[i], payload(key(i + 1), N))
    assert redis_server.call(b"EXISTS", redis.key_of(key(2))) == 1
    assert redis.stats().corrupt == 0
    out = np.zeros(N, np.uint8)
    assert redis.submit_load([(key(2), out)]).result(timeout=30).ok == (True,)
    np.testing.assert_array_equal(out, payload(key(2), N))


@needs_redis
def test_a_value_of_the_right_length_with_a_forged_header_length_is_still_removed(
    redis, redis_server
):
    # The header decides only when it is whole and agrees with the value's length.
    assert store(redis, [1]).all_ok
    k = redis.key_of(key(1))
    redis_server.call(b"APPEND", k, b"\x00" * 10)  # 10 bytes longer than any entry
    r = redis.submit_load([(key(1), np.zeros(N, np.uint8))]).result(timeout=30)
    assert r.ok == (False,) and redis.stats().corrupt == 1
    assert redis_server.call(b"EXISTS", k) == 0


def test_a_host_name_whose_lookup_hangs_costs_at_most_connect_timeout(monkeypatch):
    # getaddrinfo has no timeout of its own (a slow DNS server: 5 s per try and server
    # by default). Before: socket.create_connection looked the name up unbounded, so
    # contains() and the I/O threads hung past connect_timeout_s.
    real = socket.getaddrinfo
    release = threading.Event()

    def getaddrinfo(host, *args, **kw):
        numeric = (kw.get("flags", 0) | (args[4] if len(args) > 4 else 0)) & socket.AI_NUMERICHOST
        if host == "slow-dns.example" and not numeric:  # a literal needs no DNS
            release.wait(20)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    tier = RedisTier(
        RedisTierConfig(
            url="redis://slow-dns.example:6379/0",
            connect_timeout_s=0.3,
            io_timeout_s=0.5,
            retry_after_s=0.1,
            read_connections=1,
            write_connections=1,
        ),
        NS,
    )
    try:
        start = time.monotonic()
        assert tier.contains([key(1)]) == [False]
        assert time.monotonic() - start < 2.0
        time.sleep(0.15)  # past retry_after_s: the I/O threads try to connect too
        start = time.monotonic()
        r = tier.submit_load([(key(1), np.zeros(16, np.uint8))]).result(timeout=10)
        assert r.ok == (False,) and time.monotonic() - start < 2.0
        assert tier.stats().errors >= 1
    finally:
        release.set()
        tier.close()


def test_a_literal_address_needs_no_lookup_thread(monkeypatch):
    from jax_kvoffload.tiers import _resp

    started = []
    monkeypatch.setattr(
        _resp.threading, "Thread", lambda *a, **kw: started.append(kw) or threading.Thread()
    )
    addrs = _resp._resolve("127.0.0.1", 6379, 0.5)
    assert addrs and started == []


@needs_redis
def test_a_server_killed_mid_pipeline_means_misses_never_a_hang_or_a_wrong_byte():
    server = RedisServer(maxmemory="256mb")
    big = 1 << 20
    try:
        tier = open_redis(server.url, read_connections=2, batch_bytes=4 << 20)
        try:
            ids = list(range(48))
            assert store(tier, ids, big).all_ok
            outs = [np.full(big, 0xAA, np.uint8) for _ in ids]
            killer = threading.Timer(0.02, server.proc.kill)
            killer.start()
            start = time.monotonic()
            r = tier.submit_load([(key(i), o) for i, o in zip(ids, outs)]).result(timeout=30)
            killer.join()
            assert time.monotonic() - start < 10
            for i, o, ok in zip(ids, outs, r.ok):
                if ok:
                    np.testing.assert_array_equal(o, payload(key(i), big))
            assert tier.stats().corrupt == 0
            # Stores against the dead server: failed or dropped, quickly.
            r = tier.submit_store([(key(99), payload(key(99), 64))]).result(timeout=10)
            assert r.ok == (False,)
        finally:
            tier.close()
    finally:
        server.stop()


def test_a_lookup_thread_that_cannot_start_gives_its_slot_back(monkeypatch):
    # A process out of threads (RuntimeError: can't start new thread) kept the slot of
    # every lookup it could not start: after 8 such failures each lookup was refused as
    # "8 still running" for the life of the process, with none running. And the
    # RuntimeError left contains() (which must answer misses, never raise).
    from jax_kvoffload.tiers import _resp

    real_start = threading.Thread.start
    exhausted = [True]

    def start(self):
        if exhausted[0] and self.name == "redis-tier-resolve":
            raise RuntimeError("can't start new thread")
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    for _ in range(_resp._MAX_STUCK_LOOKUPS + 1):
        with pytest.raises(OSError, match="can't start"):
            _resp._resolve("localhost", 6379, 2.0)
    tier = RedisTier(RedisTierConfig(url="redis://localhost:1/0", retry_after_s=0.01), NS)
    try:
        assert tier.contains([key(1)]) == [False]  # a miss, not an exception
    finally:
        tier.close()
    exhausted[0] = False
    assert _resp._resolve("localhost", 6379, 2.0)  # threads again: the lookup runs


@pytest.mark.parametrize("unix", [False, True])
def test_a_connect_that_fails_after_the_socket_exists_closes_it(tmp_path, unix):
    # A unix socket path that is not listening: the socket stayed open for as long as
    # the error was kept (its traceback holds the frame): a log handler or an error
    # reporter keeping errors leaked a descriptor per attempt, one per retry_after_s
    # for as long as the outage lasted. (A refused TLS handshake: ssl closes its own.)
    import os
    import ssl

    from jax_kvoffload.tiers._resp import Endpoint, RespConnection, RespConnectionError

    listener = socket.socket(socket.AF_UNIX if unix else socket.AF_INET)
    where = str(tmp_path / "s.sock") if unix else ("127.0.0.1", 0)
    listener.bind(where)
    if not unix:
        listener.listen(4)

        def hang_up():
            for _ in range(4):
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                conn.close()

        threading.Thread(target=hang_up, daemon=True).start()
    tls = None if unix else ssl.create_default_context()
    host, port = (None, 6379) if unix else listener.getsockname()
    ep = Endpoint(host, port, where if unix else None, 0, None, None, tls, None, 2.0, 2.0)
    before = len(os.listdir("/proc/self/fd"))
    kept = []
    try:
        for _ in range(3):
            with pytest.raises(RespConnectionError) as info:
                RespConnection(ep).connect()
            kept.append(info.value)  # as a handler that keeps errors would
        assert len(os.listdir("/proc/self/fd")) == before, "sockets left open"
    finally:
        listener.close()
