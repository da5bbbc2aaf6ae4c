"""RedisTier against a real redis-server of its own (loopback, no persistence, LRU
eviction): round trips, reuse across tier objects and processes, damaged values, other
namespaces, a server that is down, paused or evicting, AUTH, and many threads at once."""

from __future__ import annotations

import subprocess
import threading
import time

import numpy as np
import pytest

from jax_kvoffload.tiers import RedisTier, RedisTierConfig
from jax_kvoffload.tiers._redis import redis_key

from ._helpers import (
    NO_REDIS,
    REDIS_SERVER,
    RedisServer,
    free_port,
    key,
    payload,
    run_child,
)

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason=NO_REDIS)

NS = bytes(range(32))
N = 8192


def open_redis(url, ns=NS, **kw):
    kw.setdefault("io_timeout_s", 2.0)
    return RedisTier(RedisTierConfig(url=url, **kw), ns)


def store(tier, ids, n=N):
    return tier.submit_store([(key(i), payload(key(i), n)) for i in ids]).result(timeout=30)


def load(tier, ids, n=N):
    outs = [np.full(n, 0xAA, np.uint8) for _ in ids]
    r = tier.submit_load([(key(i), o) for i, o in zip(ids, outs)]).result(timeout=30)
    for i, o, ok in zip(ids, outs, r.ok):
        if ok:  # a hit is exactly the stored bytes
            np.testing.assert_array_equal(o, payload(key(i), n))
    return list(r.ok)


def test_round_trip_key_format_and_value_layout(redis, redis_server):
    r = store(redis, range(5))
    assert r.all_ok and r.nbytes == 5 * N
    k = redis_key("jkv", NS, key(3))
    assert k == b"jkv:0001020304050607:" + key(3)[:-4].hex().encode() + b":0"
    assert redis_server.call(b"STRLEN", k) == 68 + 36 + N  # header + payload, one value
    assert redis.contains([key(0), key(9)]) == [True, False]
    assert load(redis, [4, 9, 0]) == [True, False, True]
    s = redis.stats()
    assert (s.keys_stored, s.load_hits, s.load_misses, s.corrupt, s.errors) == (5, 2, 1, 0, 0)
    assert redis.medium == "remote"


def test_batches_spread_a_large_job_over_connections(redis_server):
    redis_server.call(b"FLUSHALL")
    tier = open_redis(redis_server.url, batch_bytes=3 * N)
    try:
        assert store(tier, range(10)).all_ok
        assert load(tier, list(range(10))) == [True] * 10
    finally:
        tier.close()


def test_a_new_tier_object_and_another_process_reuse_entries(redis, redis_server):
    store(redis, [1, 2])
    other = open_redis(redis_server.url)
    try:
        assert load(other, [1, 2, 3]) == [True, True, False]
    finally:
        other.close()
    code = (
        "import sys, numpy as np\n"
        "from tests.tiers._helpers import key, payload\n"
        "from jax_kvoffload.tiers import RedisTier, RedisTierConfig\n"
        "t = RedisTier(RedisTierConfig(url=sys.argv[1]), bytes(range(32)))\n"
        "o = np.zeros(8192, np.uint8)\n"
        "r = t.submit_load([(key(1), o)]).result()\n"
        "assert r.ok == (True,) and (o == payload(key(1), 8192)).all()\n"
        "assert t.submit_store([(key(7), payload(key(7), 8192))]).result().all_ok\n"
        "t.close()\n"
    )
    out = run_child(code, redis_server.url)
    assert out.returncode == 0, out.stderr
    assert load(redis, [7]) == [True]


@pytest.mark.parametrize(
    "damage",
    [
        lambda s, k: s.call(b"SETRANGE", k, b"200", b"\x00\xff"),  # payload bytes
        lambda s, k: s.call(b"SETRANGE", k, b"20", b"\xff"),  # namespace in the header
        lambda s, k: s.call(b"SET", k, s.call(b"GETRANGE", k, b"0", b"-2")),  # truncated
        lambda s, k: s.call(b"SET", k, b"junk"),
    ],
    ids=["payload", "header", "truncated", "junk"],
)
def test_a_damaged_value_is_a_miss_and_is_removed(redis, redis_server, damage):
    store(redis, [1, 2, 3])
    k = redis.key_of(key(2))
    damage(redis_server, k)
    assert load(redis, [1, 2, 3]) == [True, False, True]
    assert redis_server.call(b"EXISTS", k) == 0
    assert redis.stats().corrupt == 1
    assert load(redis, [1, 3]) == [True, True]  # the connection stayed in sync


def test_another_namespace_is_a_miss(redis, redis_server):
    store(redis, [1])
    other = open_redis(redis_server.url, ns=bytes(32))
    try:
        assert other.contains([key(1)]) == [False]
        assert load(other, [1]) == [False]
        # Our bytes under the other namespace's key: the header says whose they are.
        value = redis_server.call(b"GET", redis.key_of(key(1)))
        redis_server.call(b"SET", other.key_of(key(1)), value)
        assert load(other, [1]) == [False]
        assert other.stats().corrupt == 1
    finally:
        other.close()


def test_a_server_that_is_down_means_misses_and_dropped_stores_quickly(caplog):
    tier = open_redis(
        f"redis://127.0.0.1:{free_port()}/0", connect_timeout_s=0.5, retry_after_s=5.0
    )
    try:
        t0 = time.monotonic()
        assert tier.contains([key(1)]) == [False]
        assert load(tier, [1, 2]) == [False, False]
        r = store(tier, [1])
        assert r.dropped and not r.all_ok  # down: dropped at submission, never queued
        assert time.monotonic() - t0 < 3
        s = tier.stats()
        assert (s.stores_dropped, s.keys_dropped) == (1, 1) and s.errors >= 1
        downs = [r for r in caplog.records if "retrying in" in r.getMessage()]
        assert len([r for r in downs if r.levelname == "WARNING"]) == 1  # logged once
    finally:
        tier.close()


def test_a_paused_server_costs_at_most_the_timeout_then_recovers():
    server = RedisServer()
    try:
        tier = open_redis(server.url, io_timeout_s=0.5, retry_after_s=0.3)
        try:
            assert store(tier, [1, 2]).all_ok
            server.pause()  # SIGSTOP: connections stay open, nothing answers
            t0 = time.monotonic()
            assert load(tier, [1, 2]) == [False, False]
            assert tier.contains([key(1)]) == [False]
            assert time.monotonic() - t0 < 3
            assert store(tier, [3]).dropped
            server.resume()
            deadline = time.monotonic() + 10
            while load(tier, [1, 2]) != [True, True]:
                assert time.monotonic() < deadline, "the tier did not come back"
                time.sleep(0.1)
        finally:
            tier.close()
    finally:
        server.stop()


def test_an_evicting_server_means_misses_never_wrong_bytes():
    server = RedisServer(maxmemory="2mb")
    try:
        tier = open_redis(server.url)
        try:
            for i in range(0, 60, 6):  # ~3.8 MiB into a 2 MiB server
                store(tier, range(i, i + 6), n=64 * 1024)
            oks = load(tier, list(range(60)), n=64 * 1024)
            assert 0 < sum(oks) < 60
            info = server.call(b"INFO", b"stats").decode()
            assert int(info.split("evicted_keys:")[1].split()[0]) > 0
        finally:
            tier.close()
    finally:
        server.stop()


def test_a_server_refusing_writes_fails_those_stores():
    server = RedisServer(maxmemory="4mb", policy="noeviction")
    try:
        tier = open_redis(server.url)
        try:
            results = [store(tier, [i], n=256 * 1024) for i in range(24)]
            assert results[0].all_ok and not all(r.all_ok for r in results)
            assert tier.stats().store_failures >= 1
            assert load(tier, [0], n=256 * 1024) == [True]
        finally:
            tier.close()
    finally:
        server.stop()


def test_auth_and_password_from_the_environment(monkeypatch):
    server = RedisServer("--requirepass", "s3cret")
    try:
        no = open_redis(server.url, connect_timeout_s=0.5)
        try:
            assert store(no, [1]).ok == (False,)  # NOAUTH: the session is refused
        finally:
            no.close()
        monkeypatch.setenv("JKV_TEST_REDIS_PASSWORD", "s3cret")
        yes = open_redis(server.url, password_env="JKV_TEST_REDIS_PASSWORD")
        in_url = open_redis(f"redis://:s3cret@127.0.0.1:{server.port}/2")
        try:
            assert store(yes, [1]).all_ok and load(yes, [1]) == [True]
            assert load(in_url, [1]) == [False]  # database 2 is another keyspace
        finally:
            yes.close()
            in_url.close()
    finally:
        server.stop()


def test_concurrent_writers_and_readers(redis):
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(15):
                store(redis, [int(i) for i in rng.choice(20, 3, replace=False)])
                load(redis, [int(i) for i in rng.choice(20, 4, replace=False)])
                redis.contains([key(int(i)) for i in rng.choice(20, 2)])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert redis.stats().corrupt == 0 and redis.stats().errors == 0


def make_certs(d) -> dict[str, str]:
    """A throw-away CA and a server certificate for localhost / 127.0.0.1."""

    def ossl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ossl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=jkv-test-ca",
    )
    ossl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "srv.key",
        "-out",
        "srv.csr",
        "-subj",
        "/CN=localhost",
    )
    (d / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    ossl(
        "x509",
        "-req",
        "-in",
        "srv.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "srv.pem",
        "-days",
        "1",
        "-extfile",
        "ext.cnf",
    )
    return {n: str(d / n) for n in ("ca.pem", "srv.pem", "srv.key")}


@pytest.mark.skipif(__import__("shutil").which("openssl") is None, reason="needs openssl")
def test_tls(tmp_path):
    certs = make_certs(tmp_path)
    tls_port = free_port()
    try:
        server = RedisServer(
            "--tls-port",
            str(tls_port),
            "--tls-cert-file",
            certs["srv.pem"],
            "--tls-key-file",
            certs["srv.key"],
            "--tls-ca-cert-file",
            certs["ca.pem"],
            "--tls-auth-clients",
            "no",
        )
    except RuntimeError as e:  # a redis-server built without TLS
        pytest.skip(f"redis-server cannot serve TLS here: {e}")
    url = f"rediss://localhost:{tls_port}/0"
    try:
        good = open_redis(url, tls_ca_file=certs["ca.pem"])
        untrusted = open_redis(url, connect_timeout_s=1.0)  # the system CAs do not know it
        unverified = open_redis(url, tls_verify=False)
        try:
            big = 3 * 1024 * 1024  # larger than a TLS record and a socket buffer
            assert store(good, [1], n=big).all_ok and load(good, [1], n=big) == [True]
            assert store(untrusted, [2]).ok == (False,) and load(untrusted, [1], n=big) == [False]
            assert load(unverified, [1], n=big) == [True]
        finally:
            for t in (good, untrusted, unverified):
                t.close()
    finally:
        server.stop()


def test_a_refused_read_is_a_miss_not_a_corrupt_entry(redis, redis_server):
    # An ACL user that may write but not read: the server's error is not the entry's fault.
    store(redis, [1])
    redis_server.call(b"ACL", b"SETUSER", b"writer", b"on", b">pw", b"~*", b"+set", b"+ping")
    limited = open_redis(f"redis://writer:pw@127.0.0.1:{redis_server.port}/0")
    try:
        assert load(limited, [1]) == [False]
        assert limited.stats().corrupt == 0
        assert load(redis, [1]) == [True]  # the entry was not removed
    finally:
        limited.close()
        redis_server.call(b"ACL", b"DELUSER", b"writer")


def test_a_restarted_server_is_used_again_at_once():
    server = RedisServer()
    try:
        tier = open_redis(server.url, retry_after_s=30.0, read_connections=1, write_connections=1)
        try:
            assert store(tier, [1]).all_ok and load(tier, [1]) == [True]
            assert tier.contains([key(1)]) == [True]
            port = server.port
            server.stop()
            server = RedisServer(port=port)  # empty, same address
            # Every connection of the tier was open to the old server: each is retried
            # once on a fresh connection instead of putting the tier down for 30 s.
            assert tier.contains([key(1)]) == [False]
            assert store(tier, [2]).all_ok
            assert load(tier, [2, 1]) == [True, False]
            assert tier.available() and tier.stats().errors == 0
        finally:
            tier.close()
    finally:
        server.stop()
