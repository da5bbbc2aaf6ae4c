"""Randomized soak of `KVOffloader` over the real tiers (a disk directory and a private
redis-server) while the operator and the machine misbehave.

`test_tier_soak.py` drives the tier path against an in-memory fake; here the bytes go
through real files and a real server, and each offloader life opens the tiers afresh
(a restart: the disk tier rescans, the Redis tier reconnects). Between the engine's
steps (stores, lookups with and without waiting, loads, polls, `flush_tiers`, resets,
closes): the Redis server paused with SIGSTOP for 0.1-0.8 s, the disk full (writes
refused with ENOSPC), a byte of a disk entry or of a Redis value flipped, a shard
directory removed, a Redis key deleted.

Checked: every block a successful load reports holds `content(hash)`, every job of
each life is reported exactly once, no pin or write-pending chunk after a close, no
step takes longer than a bound (the Redis timeouts), no tier thread or temporary file
left. Any failure prints its seed.

The same soak runs on the session's 3-primary Redis Cluster (`redis_cluster`) in
place of the server: the tier is given one node's URL (a random one each seed), so keys
of the other primaries take a redirect first; one primary at a time is paused, and
entries are damaged or deleted on the node that holds them.

CI size: JAX_KVOFFLOAD_REAL_TIER_SOAK_STEPS (default 250) for each seed of
JAX_KVOFFLOAD_REAL_TIER_SOAK_SEEDS (default 0,1) and of
JAX_KVOFFLOAD_REAL_TIER_SOAK_CLUSTER_SEEDS (default 2).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import threading
import time

import numpy as np
import pytest

from jax_kvoffload.errors import KVOffloadError
from jax_kvoffload.tiers._slots import key_slot
from tests.faults._helpers import (
    Reports,
    blocks,
    config,
    expected,
    hashes,
    offloader,
    pins,
    write_blocks,
)
from tests.tiers._cluster import HAVE_CLUSTER, NO_CLUSTER, RedisCluster
from tests.tiers._helpers import REDIS_SERVER, RedisServer

STEPS = int(os.environ.get("JAX_KVOFFLOAD_REAL_TIER_SOAK_STEPS", "250"))
SEEDS = [int(s) for s in os.environ.get("JAX_KVOFFLOAD_REAL_TIER_SOAK_SEEDS", "0,1").split(",")]
CLUSTER_SEEDS = [
    int(s) for s in os.environ.get("JAX_KVOFFLOAD_REAL_TIER_SOAK_CLUSTER_SEEDS", "2").split(",")
]
IO_TIMEOUT_S = 0.4
STEP_BOUND_S = 10 * IO_TIMEOUT_S + 2.0  # a step waits at most for a few timed-out batches

OPS = ["store", "load", "poll", "flush", "reset", "close", "pause", "full", "flip_file",
       "rm_shard", "redis_del", "redis_flip"]  # fmt: skip
WEIGHTS = [10, 10, 3, 2, 1, 1, 1, 1, 3, 1, 1, 3]


def tier_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(("disk-tier", "redis-tier"))]


class RealTierSoak:
    def __init__(self, seed: int, root: str, server: RedisServer | None, monkeypatch) -> None:
        self.rng = random.Random(seed)
        self.root = root
        self.server = server
        self.prefix = f"soak{seed}"
        self.tiers: list[dict] = [{"type": "disk", "path": f"{root}/t", "capacity_bytes": "96KiB",
                                   "fsync": seed % 2 == 0}]  # fmt: skip
        if server is not None:
            self.tiers.append({"type": "redis", "url": server.url, "key_prefix": self.prefix,
                               "io_timeout_s": IO_TIMEOUT_S, "connect_timeout_s": 0.3,
                               "retry_after_s": 0.2})  # fmt: skip
        self.prompts = [hashes(f"rs{seed}-{i}", self.rng.randint(2, 8)) for i in range(12)]
        self.full = False
        self.paused = threading.Lock()  # held while the server is stopped
        self.resumers: list[threading.Timer] = []
        self.bad_loads = self.good_loads = 0
        real = os.pwritev

        def pwritev(fd, buffers, offset, *args):
            if self.full and os.readlink(f"/proc/self/fd/{fd}").startswith(root):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(fd, buffers, offset, *args)

        monkeypatch.setattr(os, "pwritev", pwritev)
        self.reports = Reports()
        self.off = self.new_life()

    def new_life(self):
        cfg = config(secondary_tiers=self.tiers, chunks=self.rng.randint(3, 8))
        return offloader(cfg, seed=self.rng.randint(0, 99))

    def step(self) -> None:
        op = self.rng.choices(OPS, WEIGHTS)[0]
        p = self.rng.choice(self.prompts)
        off, reports = self.off, self.reports
        try:
            if op == "store":
                ids = list(range(len(p)))
                write_blocks(off, ids, p)
                reports.issue(off.store(p, ids))
                reports.record(off.wait())
            elif op == "load":
                n = off.lookup(p, wait=self.rng.random() < 0.7)
                if self.rng.random() < 0.1:
                    n = len(p) // 2 * 2  # a load without a lookup: promotes on its own
                if n:
                    targets = list(range(16, 16 + n))
                    job = reports.issue(off.load(p[:n], targets))
                    (result,) = reports.record(off.wait([job]))
                    if result.success:
                        self.good_loads += 1
                        got = blocks(off, targets)
                        self.bad_loads += not np.array_equal(got, expected(p[:n]))
            elif op == "poll":
                reports.record(off.poll())
            elif op == "flush":
                off.flush_tiers(timeout=5)
            elif op == "reset":
                off.reset_cache()
            elif op == "close":
                self.close_life()
                self.off = self.new_life()
            elif op == "full":
                self.full = not self.full
            elif op in ("flip_file", "rm_shard"):
                self.hurt_disk(op)
            elif op == "pause":
                self.pause()
            else:
                self.hurt_redis(op)
        except KVOffloadError:
            pass  # a refused call (e.g. a load of keys a reset forgot): changes nothing

    def close_life(self) -> None:
        self.reports.record(self.off.close())
        assert pins(self.off) == (0, 0)
        self.reports.check_exactly_once()
        self.reports = Reports()

    def hurt_disk(self, op: str) -> None:
        files = [os.path.join(d, f) for d, _, fs in os.walk(f"{self.root}/t") for f in fs
                 if f.endswith(".kv")]  # fmt: skip
        if not files:
            return
        victim = self.rng.choice(files)
        try:
            if op == "rm_shard":
                shutil.rmtree(os.path.dirname(victim))
                return
            at = 4096 + self.rng.randrange(512)  # in the payload: 4 KiB header, then 512 B
            with open(victim, "r+b") as f:
                f.seek(at)
                byte = f.read(1)[0]
                f.seek(at)
                f.write(bytes([byte ^ self.rng.randrange(1, 256)]))  # a byte that changes
        except OSError:
            pass  # evicted meanwhile

    def pause(self) -> None:
        if self.server is None or not self.paused.acquire(blocking=False):
            return
        self.server.pause()

        def resume():
            self.server.resume()
            self.paused.release()

        timer = threading.Timer(self.rng.uniform(0.1, 0.8), resume)
        self.resumers.append(timer)
        timer.start()

    def hurt_redis(self, op: str) -> None:
        if self.server is None or not self.paused.acquire(blocking=False):
            return
        try:
            keys = self.server.call(b"KEYS", f"{self.prefix}:*".encode()) or []
            if keys:
                k = self.rng.choice(keys)
                if op == "redis_del":
                    self.server.call(b"DEL", k)
                else:
                    at = self.rng.randrange(128, 600)  # in the payload: header ~100 B, 512 B
                    byte = self.server.call(b"GETRANGE", k, b"%d" % at, b"%d" % at)[0]
                    flipped = bytes([byte ^ self.rng.randrange(1, 256)])
                    self.server.call(b"SETRANGE", k, b"%d" % at, flipped)
        finally:
            self.paused.release()

    def finish(self) -> None:
        for timer in self.resumers:
            timer.join()
        self.reports.record(self.off.wait())
        self.close_life()


class ClusterFaults:
    """A cluster seen as the soak's server: `url` one node's, `pause()` stops one
    primary (drawn at random) until `resume()`, `call()` goes to the node holding the
    key (KEYS: every primary)."""

    def __init__(self, cluster: RedisCluster, rng: random.Random) -> None:
        self.cluster = cluster
        self.rng = rng
        self.url = f"redis://127.0.0.1:{rng.choice(cluster.ports)}/0"
        self.paused: RedisServer | None = None

    def pause(self) -> None:
        self.paused = self.cluster.nodes[self.rng.choice(self.cluster.primaries())]
        self.paused.pause()

    def resume(self) -> None:
        if self.paused is not None:
            self.paused.resume()
            self.paused = None

    def call(self, *args: bytes):
        if args[0] == b"KEYS":
            return [k for ks in self.cluster.keys(args[1]).values() for k in ks]
        return self.cluster.nodes[self.cluster.owner(key_slot(args[1]))].call(*args)


def run_soak(tmp_path, monkeypatch, seed, server) -> None:
    soak = RealTierSoak(seed, str(tmp_path), server, monkeypatch)
    slowest = 0.0
    for i in range(STEPS):
        start = time.monotonic()
        soak.step()
        slowest = max(slowest, time.monotonic() - start)
        assert slowest < STEP_BOUND_S, f"seed {seed}: step {i} took {slowest:.1f} s"
    soak.finish()
    assert soak.bad_loads == 0, f"seed {seed}: {soak.bad_loads} loads with wrong bytes"
    assert tier_threads() == [], f"seed {seed}: {tier_threads()}"
    tmp = [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".tmp")]
    assert tmp == [], f"seed {seed}: temporary files left: {tmp}"
    print(f"seed {seed}: {soak.good_loads} loads served, slowest step {slowest:.2f} s")


@pytest.mark.slow  # a soak on a real disk tier and Redis server
@pytest.mark.parametrize("seed", SEEDS)
def test_real_tier_soak(tmp_path, monkeypatch, seed):
    server = RedisServer(maxmemory="2mb") if REDIS_SERVER is not None else None
    try:
        run_soak(tmp_path, monkeypatch, seed, server)
    finally:
        if server is not None:
            server.stop()


@pytest.mark.slow  # a soak on a real Redis Cluster
@pytest.mark.skipif(not HAVE_CLUSTER, reason=NO_CLUSTER)
@pytest.mark.parametrize("seed", CLUSTER_SEEDS)
def test_real_tier_soak_on_a_cluster(tmp_path, monkeypatch, seed, redis_cluster):
    faults = ClusterFaults(redis_cluster, random.Random(seed))
    try:
        run_soak(tmp_path, monkeypatch, seed, faults)
    finally:
        faults.resume()
        redis_cluster.wait_ok()
