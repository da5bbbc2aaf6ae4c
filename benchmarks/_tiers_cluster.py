"""The Redis Cluster part of benchmarks/tiers.py (`--cluster`).

Starts a 3-primary and a 1-primary Redis Cluster on free loopback ports (Debian's
`redis-server --cluster-enabled yes`; `redis-cli --cluster create` for 3, `CLUSTER
ADDSLOTSRANGE 0 16383` for 1: `--cluster create` wants 3 primaries) and measures, in one
run, alternating which goes first:

- `RedisTier` on the 3-primary cluster against `redis-benchmark --cluster` SET / GET of
  the same value size on the same cluster, with the same connections per node (the
  tier's I/O threads each hold one per node; redis-benchmark spreads `-c` over the
  nodes) and the same pipeline depth per node (target >= 0.7 each way). Each SET writes
  a new key; each GET reads an existing value (the keys of every node's hash tag are
  set first; the script checks that the nodes counted no miss).
- the tier and redis-benchmark on 3 primaries against 1 (aggregate throughput; no
  target: on one machine the nodes share its cores with the client).

With `--clients`: the tier on one connection per node against redis-py's
`RedisCluster` pipeline (with hiredis, where installed) moving the same values.
"""

from __future__ import annotations

import argparse
import contextlib
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
from _tiers_redis import CONNECTIONS, redis_benchmark, redis_tier_pass

from jax_kvoffload.tiers import RedisTier, RedisTierConfig
from jax_kvoffload.tiers._resp import Endpoint, RespConnection

TARGET = 0.7


class Cluster:
    """`primaries` cluster nodes on loopback, without replicas; `stop()` ends them."""

    def __init__(self, primaries: int, maxmemory: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="jkv-bench-cluster-")
        self.procs: list[subprocess.Popen] = []
        self.ports: list[int] = []
        try:
            for _ in range(primaries):
                self._start_node(maxmemory)
            if primaries >= 3:
                subprocess.run(
                    ["redis-cli", "--cluster", "create",
                     *[f"127.0.0.1:{p}" for p in self.ports], "--cluster-yes"],
                    capture_output=True, check=True, timeout=120,
                )  # fmt: skip
            else:
                self.call(self.ports[0], b"CLUSTER", b"ADDSLOTSRANGE", b"0", b"16383")
            self._wait_ok()
        except BaseException:
            self.stop()
            raise

    def _start_node(self, maxmemory: int) -> None:
        port = _bus_free_port()
        d = os.path.join(self.dir, str(port))
        os.mkdir(d)
        opts = {"port": port, "bind": "127.0.0.1", "save": "", "appendonly": "no",
                "maxmemory": maxmemory, "maxmemory-policy": "allkeys-lru", "dir": d,
                "cluster-enabled": "yes", "cluster-config-file": "nodes.conf",
                "loglevel": "warning"}  # fmt: skip
        cmd = ["redis-server"] + [a for k, v in opts.items() for a in (f"--{k}", str(v))]
        self.procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
        self.ports.append(port)
        for _ in range(500):
            try:
                socket.create_connection(("127.0.0.1", port), 0.1).close()
                return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {port} did not start")

    @staticmethod
    def call(port: int, *args: bytes):
        conn = connection(port)
        conn.connect()
        try:
            return conn.call(*args)
        finally:
            conn.close()

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + 60
        while not all(b"cluster_state:ok" in self.call(p, b"CLUSTER", b"INFO") for p in self.ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the benchmark's cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def flush(self) -> None:
        for p in self.ports:
            self.call(p, b"FLUSHALL")

    def misses(self) -> int:
        """The nodes' keyspace_misses counters, summed."""
        total = 0
        for p in self.ports:
            info = self.call(p, b"INFO", b"stats").decode()
            total += int(info.split("keyspace_misses:")[1].split()[0])
        return total

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def connection(port: int) -> RespConnection:
    return RespConnection(Endpoint("127.0.0.1", port, None, 0, None, None, None, None, 2.0, 60.0))


def _bus_free_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 <= 65535:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                    return port
                except OSError:
                    pass
    raise RuntimeError("no free (port, port + 10000) pair on loopback")


def fill_benchmark_keys(cluster: Cluster, per_node: int, size: int) -> None:
    """Sets the keys `redis-benchmark --cluster` GETs with `-r per_node`: on each node
    `key:{TAG}:<12 digits>` 0..per_node-1, TAG the hash tag it picked for that node
    (read back from a SET run on key 0 alone, into the emptied cluster). One node:
    `key:<12 digits>`, as plain redis-benchmark (`--cluster` refuses a 1-node cluster)."""
    cluster.flush()
    names: dict[int, list] = {}
    if len(cluster.ports) > 1:
        rb = ["redis-benchmark", "--cluster", "-p", str(cluster.ports[0])]
        # A run may leave a node without its key (seen once in CI on a busy machine: its
        # clients' requests all went elsewhere): run again until every node holds one.
        for _ in range(5):
            subprocess.run([*rb, "-t", "set", "-n", str(20 * len(cluster.ports)), "-r", "1",
                            "-d", "1", "-c", str(2 * len(cluster.ports))],
                           capture_output=True, check=True, timeout=120)  # fmt: skip
            names = {port: cluster.call(port, b"KEYS", b"key:*") for port in cluster.ports}
            if all(len(n) == 1 for n in names.values()):
                break
        else:
            raise RuntimeError(f"redis-benchmark --cluster left the nodes with keys {names}")
    value = os.urandom(size)
    for port in cluster.ports:
        if len(cluster.ports) > 1:
            (name,) = names[port]
            prefix = name.rsplit(b":", 1)[0]
        else:
            prefix = b"key"
        conn = connection(port)
        conn.connect()
        try:
            for a in range(0, per_node, 16):
                ks = [b"%s:%012d" % (prefix, i) for i in range(a, min(per_node, a + 16))]
                conn.begin()
                conn.send([b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, size) + value
                           + b"\r\n" for k in ks])  # fmt: skip
                assert all(conn.read_reply() == "OK" for _ in ks)
        finally:
            conn.close()


def baseline_pass(cluster: Cluster, size: int, n: int, depth: int, times: dict, tag: str) -> None:
    """redis-benchmark --cluster SET then GET of `n` values: one connection per tier
    thread and node, `depth` values pipelined (one node: without --cluster, which
    refuses it; every slot is that node's, so no key is redirected either way)."""
    conns = CONNECTIONS * len(cluster.ports)
    rps = redis_benchmark("127.0.0.1", cluster.ports[0], "set", size, n, conns, depth,
                          keyspace=10**9, cluster=len(cluster.ports) > 1)  # fmt: skip
    times.setdefault(f"set{tag}", []).append(n / rps)
    per_node = max(1, n // len(cluster.ports))
    fill_benchmark_keys(cluster, per_node, size)
    misses = cluster.misses()
    rps = redis_benchmark("127.0.0.1", cluster.ports[0], "get", size, n, conns, depth,
                          keyspace=per_node, cluster=len(cluster.ports) > 1)  # fmt: skip
    times.setdefault(f"get{tag}", []).append(n / rps)
    assert cluster.misses() == misses, "redis-benchmark --cluster GET missed"


def open_cluster_tier(cluster: Cluster, size: int, n: int, depth: int, conns: int) -> RedisTier:
    # A batch of `depth` values per node: one pipeline per node of redis-benchmark's depth.
    batch = depth * 3 * size
    return RedisTier(
        RedisTierConfig(url=cluster.url, cluster="on", read_connections=conns,
                        write_connections=conns, batch_bytes=batch,
                        max_pending_store_bytes=2 * n * size),
        NS,
    )  # fmt: skip


def bench_cluster(
    args: argparse.Namespace, out_rows: list[dict], step: Callable[[str], None]
) -> None:
    """Appends the cluster rows (and, with `--clients`, the client rows) to `out_rows`."""
    size = int(args.value_kib * 1024)
    n = args.values
    depth = max(1, (args.batch_mib * MiB) // size)
    job = depth * 3 * CONNECTIONS  # one job feeds every thread with a batch
    m, rows = rows_buffer(n, size)
    dest_m, dest = rows_buffer(n, size)
    clusters: dict[str, Cluster] = {}
    try:
        clusters["3"] = Cluster(3, 2 * n * size + 64 * MiB)  # keys spread unevenly
        clusters["1"] = Cluster(1, 4 * n * size + 64 * MiB)
        tiers = {t: open_cluster_tier(c, size, n, depth, CONNECTIONS) for t, c in clusters.items()}
        times: dict[str, list[float]] = {}
        for rep in range(args.repeats):
            step(f"redis cluster: repeat {rep + 1}/{args.repeats}, {n} x {args.value_kib:g} KiB")
            order = [("tier", "3"), ("baseline", "3"), ("tier", "1"), ("baseline", "1")]
            for which, tag in order[:: 1 if rep % 2 == 0 else -1]:
                cluster = clusters[tag]
                if which == "tier":
                    t: dict[str, list[float]] = {}
                    redis_tier_pass(tiers[tag], rows, dest, keys(n, b"c%d" % rep), job, t)
                    times.setdefault(f"store{tag}", []).append(t["store"][0])
                    times.setdefault(f"load{tag}", []).append(t["load"][0])
                else:
                    baseline_pass(cluster, size, n, depth, times, tag)
                cluster.flush()
        for tier in tiers.values():
            tier.close()
        med = {k: statistics.median(v) for k, v in times.items()}
        nbytes = n * size
        for op, test in (("store", "set"), ("load", "get")):
            base = f"redis-benchmark --cluster {test.upper()} -c {3 * CONNECTIONS} -P {depth}"
            out_rows.append(tier_row("redis cluster, 3 primaries", op, nbytes, med[f"{op}3"],
                                     base, med[f"{test}3"], TARGET))  # fmt: skip
        for op, test in (("store", "set"), ("load", "get")):
            out_rows.append(tier_row("redis cluster tier: 3 primaries vs 1", op, nbytes,
                                     med[f"{op}3"], "the tier on 1 primary", med[f"{op}1"],
                                     None))  # fmt: skip
            out_rows.append(tier_row(f"redis-benchmark {test.upper()}: 3 primaries vs 1", op,
                                     nbytes, med[f"{test}3"], "redis-benchmark on 1 primary",
                                     med[f"{test}1"], None))  # fmt: skip
        if args.clients:
            step(f"redis cluster clients: {min(n, 64)} pipelined values, one connection a node")
            bench_cluster_clients(clusters["3"], rows[: min(n, 64)], out_rows)
    finally:
        for cluster in clusters.values():
            cluster.stop()
        del rows, dest
        with contextlib.suppress(BufferError):  # an error's traceback may hold a view
            m.close()
            dest_m.close()


def bench_cluster_clients(cluster: Cluster, rows: np.ndarray, out_rows: list[dict]) -> None:
    """SET / GET of `rows`, pipelined on one connection per node: the tier (one I/O
    thread, one job) and redis-py's RedisCluster pipeline."""
    n, size = rows.shape
    tier = RedisTier(RedisTierConfig(url=cluster.url, cluster="on", read_connections=1,
                                     write_connections=1, batch_bytes=n * size,
                                     max_pending_store_bytes=2 * n * size), NS)  # fmt: skip
    dest = np.zeros_like(rows)
    ks = keys(n, b"cli")

    def tier_set():
        assert tier.submit_store(list(zip(ks, rows))).result().all_ok

    def tier_get():
        assert tier.submit_load(list(zip(ks, dest))).result().all_ok

    clients = {"ours (the tier, one thread)": (tier_set, tier_get)}
    try:
        import redis
        from redis.cluster import ClusterNode, RedisCluster

        rc = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in cluster.ports])
        values = [r.tobytes() for r in rows]  # redis-py takes bytes (one copy, not timed)

        def rp(op):
            def run():
                p = rc.pipeline()
                for k, v in zip(ks, values):
                    p.set(b"rp" + k, v) if op == "set" else p.get(b"rp" + k)
                p.execute()

            return run

        hi = "hiredis" if redis.utils.HIREDIS_AVAILABLE else "python parser"
        clients[f"redis-py RedisCluster ({hi})"] = (rp("set"), rp("get"))
    except ImportError:
        rc = None
    try:
        for name, (s, g) in clients.items():
            for op, fn in (("cluster client SET", s), ("cluster client GET", g)):
                secs = _report.median(fn, 3, warmup=True)
                out_rows.append(info_row("client", name, op, n * size, secs))
    finally:
        tier.close()
        if rc is not None:
            rc.close()
