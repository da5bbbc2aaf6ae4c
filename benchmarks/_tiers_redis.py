"""The Redis part of benchmarks/tiers.py: `RedisTier` against `redis-benchmark`.

`RedisTier` against `redis-benchmark` SET / GET at the same value size, the same number
of connections and the same pipeline depth, against the same server (one started here on
a free loopback port, or `--redis-url` of a scratch server: redis-benchmark writes
`key:*` keys into it; target >= 0.7). Each SET writes a new key and each GET reads an
existing value, as the tier's do. With `--clients`, the client choice: our RESP client
against redis-py (+hiredis) and coredis, pipelined, one connection each.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable

import _report
import numpy as np
from _tiers_common import NS, MiB, info_row, keys, rows_buffer, tier_row

from jax_kvoffload.tiers import RedisTier, RedisTierConfig

TARGET = 0.7
CONNECTIONS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(maxmemory: int) -> tuple[subprocess.Popen, int, str]:
    """A private `redis-server` on a free loopback port: (process, port, its directory)."""
    port, d = free_port(), tempfile.mkdtemp(prefix="jkv-bench-redis-")
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            str(maxmemory),
            "--maxmemory-policy",
            "allkeys-lru",
            "--dir",
            d,
        ],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), 0.1).close()
            break
        except OSError:
            time.sleep(0.02)
    return proc, port, d


def redis_benchmark(
    host: str,
    port: int,
    test: str,
    size: int,
    n: int,
    c: int,
    p: int,
    *,
    keyspace: int,
    cluster: bool = False,
) -> float:
    """Requests per second of `redis-benchmark -t test` on keys `key:<0..keyspace-1>`
    (`cluster`: `--cluster`, keys `key:{TAG}:<...>` with one hash tag per node)."""
    out = subprocess.run(
        [
            "redis-benchmark",
            *(["--cluster"] if cluster else []),
            "-h",
            host,
            "-p",
            str(port),
            "-t",
            test,
            "-d",
            str(size),
            "-n",
            str(n),
            "-c",
            str(c),
            "-P",
            str(p),
            "-r",
            str(keyspace),
            "--csv",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    line = [ln for ln in out.splitlines() if ln.startswith(f'"{test.upper()}"')][-1]
    return float(line.split(",")[1].strip('"'))


def redis_tier_pass(tier, rows, dest, ks, job: int, times: dict) -> None:
    """Stores the rows under new keys `ks`, loads them back; appends both times."""
    n = len(ks)
    t0 = time.perf_counter()
    futs = [
        tier.submit_store([(ks[i], rows[i]) for i in range(a, min(n, a + job))])
        for a in range(0, n, job)
    ]
    ok = all(f.result().all_ok for f in futs)
    times.setdefault("store", []).append(time.perf_counter() - t0)
    dest[:] = 0
    t0 = time.perf_counter()
    futs = [
        tier.submit_load([(ks[i], dest[i]) for i in range(a, min(n, a + job))])
        for a in range(0, n, job)
    ]
    ok = ok and all(f.result().all_ok for f in futs)
    times.setdefault("load", []).append(time.perf_counter() - t0)
    assert ok and np.array_equal(dest, rows), "redis tier lost or changed bytes"


def redis_baseline_pass(url: str, size: int, n: int, conns: int, depth: int, times: dict) -> None:
    """redis-benchmark SET then GET of `n` values of `size` bytes; appends both times."""
    ep = RedisTierConfig(url=url).endpoint
    host, port = ep["host"], ep["port"]
    # SET: n values under (almost surely) n new keys, as a tier store writes them: with
    # `-r n` a third of the SETs would overwrite a key of the same pass.
    rps = redis_benchmark(host, port, "set", size, n, conns, depth, keyspace=10**9)
    times.setdefault("set", []).append(n / rps)
    # GET: `-r n` draws keys with repeats, so every key is set first: each GET moves one
    # value, as each tier load does (checked: the server counted no keyspace miss).
    misses = fill_benchmark_keys(url, n, size)
    rps = redis_benchmark(host, port, "get", size, n, conns, depth, keyspace=n)
    times.setdefault("get", []).append(n / rps)
    assert fill_benchmark_keys(url, 0, size) == misses, "redis-benchmark GET missed"


def bench_redis(
    args: argparse.Namespace, out_rows: list[dict], step: Callable[[str], None]
) -> None:
    """Appends the Redis rows (and the client rows with `--clients`) to `out_rows`.
    `step(what)` announces each repeat (between passes, never inside a timed one)."""
    size = int(args.value_kib * 1024)
    n = args.values
    conns = CONNECTIONS
    per_batch = max(1, (args.batch_mib * MiB) // size)
    proc = None
    if args.redis_url:
        url = args.redis_url
        ep = RedisTierConfig(url=url).endpoint
        host, port = ep["host"], ep["port"]
    else:
        proc, port, d = start_redis(4 * n * size + 64 * MiB)  # tier, SET, GET passes
        host, url = "127.0.0.1", f"redis://127.0.0.1:{port}/0"
    m, rows = rows_buffer(n, size)
    try:
        tier = RedisTier(
            RedisTierConfig(
                url=url,
                read_connections=conns,
                write_connections=conns,
                batch_bytes=per_batch * size,
                max_pending_store_bytes=2 * n * size,
            ),
            NS,
        )
        dest_m, dest = rows_buffer(n, size)
        job = args.job_chunks
        times: dict[str, list[float]] = {}

        for rep in range(args.repeats):
            step(f"redis: repeat {rep + 1}/{args.repeats}, {n} x {args.value_kib:g} KiB")
            # Alternating which goes first: both meet the server in the same states.
            for which in ("tier", "baseline")[:: 1 if rep % 2 == 0 else -1]:
                if which == "tier":
                    redis_tier_pass(tier, rows, dest, keys(n, b"b%d" % rep), job, times)
                else:
                    redis_baseline_pass(url, size, n, conns, per_batch, times)
            if proc is not None:
                tier_call_flush(url)
        tier.close()
        del dest
        dest_m.close()
        med = {k: statistics.median(v) for k, v in times.items()}
        for op, test in (("store", "set"), ("load", "get")):
            base = f"redis-benchmark {test.upper()} -c {conns} -P {per_batch}"
            out_rows.append(tier_row("redis", op, n * size, med[op], base, med[test], TARGET))
        if args.clients:
            step(f"redis clients: {min(n, 64)} pipelined values, one connection each")
            bench_clients(host, port, size, min(n, 64), out_rows)
    finally:
        del rows
        m.close()
        if proc is not None:
            proc.terminate()
            proc.wait()
            shutil.rmtree(d, ignore_errors=True)


def fill_benchmark_keys(url: str, n: int, size: int) -> int:
    """Sets redis-benchmark's keys `key:<12 digits>` 0..n-1 to `size` bytes each; returns
    the server's keyspace_misses counter (to check that the GET baseline missed none)."""
    from jax_kvoffload.tiers._redis import endpoint_from_config
    from jax_kvoffload.tiers._resp import RespConnection

    conn = RespConnection(endpoint_from_config(RedisTierConfig(url=url)))
    conn.connect()
    try:
        value = os.urandom(size)
        for a in range(0, n, 16):
            ks = range(a, min(n, a + 16))
            conn.begin()
            conn.send(
                [
                    b"*3\r\n$3\r\nSET\r\n$16\r\nkey:%012d\r\n$%d\r\n" % (i, size) + value + b"\r\n"
                    for i in ks
                ]
            )
            assert all(conn.read_reply() == "OK" for _ in ks)
        info = conn.call(b"INFO", b"stats").decode()
        return int(info.split("keyspace_misses:")[1].split()[0])
    finally:
        conn.close()


def tier_call_flush(url: str) -> None:
    """Empties the benchmark's own server between repeats (never a server given by URL)."""
    from jax_kvoffload.tiers._redis import endpoint_from_config
    from jax_kvoffload.tiers._resp import RespConnection

    conn = RespConnection(endpoint_from_config(RedisTierConfig(url=url)))
    conn.connect()
    try:
        conn.call(b"FLUSHDB")
    finally:
        conn.close()


def bench_clients(host: str, port: int, size: int, n: int, out_rows: list[dict]) -> None:
    """SET / GET of `n` values, pipelined on one connection: ours, redis-py, coredis."""
    from jax_kvoffload.tiers._resp import Endpoint, RespConnection, command

    val = os.urandom(size)
    ks = [b"client:%d" % i for i in range(n)]
    sink = bytearray(size)
    conn = RespConnection(Endpoint(host, port, None, 0, None, None, None, None, 2.0, 30.0))
    conn.connect()

    def ours_set():
        conn.begin()
        parts = []
        for k in ks:
            parts += [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, size), val, b"\r\n"]
        conn.send(parts)
        for _ in ks:
            conn.read_reply()

    def ours_get():
        conn.begin()
        conn.send([command(b"GET", k) for k in ks])
        for _ in ks:
            conn.read_into(memoryview(sink)[: conn.read_bulk_header()])
            conn.end_bulk()

    clients = {"ours (RESP, zero-copy)": (ours_set, ours_get)}
    try:
        import redis

        r = redis.Redis(host=host, port=port)

        def rp(op):
            def run():
                p = r.pipeline(transaction=False)
                for k in ks:
                    p.set(k, val) if op == "set" else p.get(k)
                p.execute()

            return run

        hi = "hiredis" if redis.utils.HIREDIS_AVAILABLE else "python parser"
        clients[f"redis-py ({hi})"] = (rp("set"), rp("get"))
    except ImportError:
        pass
    try:
        import coredis

        async def cd(op):
            async with coredis.Redis(host=host, port=port) as c:

                async def once():
                    async with c.pipeline(transaction=False) as p:
                        for k in ks:
                            p.set(k, val) if op == "set" else p.get(k)

                await once()
                t0 = time.perf_counter()
                for _ in range(3):
                    await once()
                return (time.perf_counter() - t0) / 3

        clients["coredis"] = (lambda: asyncio.run(cd("set")), lambda: asyncio.run(cd("get")))
    except ImportError:
        pass
    for name, (s, g) in clients.items():
        for op, fn in (("client SET", s), ("client GET", g)):
            secs = fn() if name == "coredis" else _report.median(fn, 3, warmup=True)
            out_rows.append(info_row("client", name, op, n * size, secs))
    conn.close()
