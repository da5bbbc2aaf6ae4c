"""A real Redis Cluster on loopback for the tests: `RedisCluster(primaries, replicas)`.

Each node is Debian's `redis-server --cluster-enabled yes` on a free port whose cluster
bus port (port + 10000) is free too, in a directory of its own under one temporary
directory; `redis-cli --cluster create ... --cluster-yes` assigns the slots (and the
replicas); the constructor returns once every node says `cluster_state:ok` and agrees
on the slot map. `stop()` ends every node and removes the directories; the nodes also
die with the test process (PR_SET_PDEATHSIG, `_helpers.RedisServer`), so a crashed
run leaves none behind.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
import tempfile
import time

from ._helpers import REDIS_SERVER, RedisServer

REDIS_CLI = shutil.which("redis-cli")
NO_CLUSTER = (
    "redis-server / redis-cli are not installed (apt-get install redis-server, which "
    "brings both); .ci/run installs them"
)
HAVE_CLUSTER = REDIS_SERVER is not None and REDIS_CLI is not None


def cluster_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free as well."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port + 10000))
            return port
    raise RuntimeError("no free port pair (port, port + 10000) on loopback")


class RedisCluster:
    """`primaries` primaries with `replicas` replicas each, on loopback."""

    def __init__(
        self,
        primaries: int = 3,
        replicas: int = 0,
        *,
        node_timeout_ms: int = 5000,
        full_coverage: bool = True,
        maxmemory: str = "64mb",
        password: str | None = None,
        tls: dict[str, str] | None = None,
    ) -> None:
        self.root = tempfile.mkdtemp(prefix="jkv-cluster-")
        self.nodes: dict[int, RedisServer] = {}
        self.args = (
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            str(node_timeout_ms),
            "--cluster-require-full-coverage",
            "yes" if full_coverage else "no",
            *(("--requirepass", password, "--masterauth", password) if password else ()),
        )
        self.password = password
        self.tls = tls
        if tls:  # every node TLS only, the cluster bus too (`make_certs` of test_redis.py)
            files = ("--tls-cert-file", tls["srv.pem"], "--tls-key-file", tls["srv.key"],
                     "--tls-ca-cert-file", tls["ca.pem"])  # fmt: skip
            self.args += ("--tls-cluster", "yes", "--tls-replication", "yes", *files)
            self.args += ("--tls-auth-clients", "no")
        self.maxmemory = maxmemory
        try:
            for _ in range(primaries * (1 + replicas)):
                self.start_node(cluster_port())
            out = subprocess.run(
                [
                    REDIS_CLI,
                    "--cluster",
                    "create",
                    *[f"127.0.0.1:{p}" for p in self.nodes],
                    "--cluster-replicas",
                    str(replicas),
                    "--cluster-yes",
                    *(("-a", password, "--no-auth-warning") if password else ()),
                    *(("--tls", "--cacert", tls["ca.pem"]) if tls else ()),
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if out.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-2000:]}")
            self.wait_ok()
        except BaseException:
            self.stop()
            raise

    def start_node(self, port: int) -> RedisServer:
        args = ("--port", "0", "--tls-port", str(port)) if self.tls else ()  # the last wins
        node = RedisServer(*self.args, *args, maxmemory=self.maxmemory, port=port, parent=self.root)
        node.password = self.password
        if self.tls:
            node.tls = ssl.create_default_context(cafile=self.tls["ca.pem"])
        self.nodes[port] = node
        return node

    @property
    def ports(self) -> list[int]:
        return list(self.nodes)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def primaries(self) -> list[int]:
        """Ports of the nodes that serve slots now (asked of any live node)."""
        for node in self.nodes.values():
            if node.proc.poll() is not None:
                continue
            with contextlib.suppress(OSError, ConnectionError):
                return sorted({int(r[2][1]) for r in node.call(b"CLUSTER", b"SLOTS")})
        return []

    def owner(self, slot: int) -> int:
        for node in self.nodes.values():
            if node.proc.poll() is None:
                for first, last, primary, *_ in node.call(b"CLUSTER", b"SLOTS"):
                    if first <= slot <= last:
                        return int(primary[1])
        raise RuntimeError(f"no node serves slot {slot}")

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says cluster_state:ok and all report the same slots."""
        deadline = time.monotonic() + timeout
        while True:
            views = set()
            ok = True
            for node in self.nodes.values():
                if node.proc.poll() is not None:
                    continue
                try:
                    info = node.call(b"CLUSTER", b"INFO").decode()
                    slots = node.call(b"CLUSTER", b"SLOTS")
                except (OSError, ConnectionError):
                    ok = False
                    break
                ok = ok and "cluster_state:ok" in info
                views.add(tuple(sorted((r[0], r[1], int(r[2][1])) for r in slots)))
            if ok and len(views) == 1:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not settle within {timeout:g} s: {views}")
            time.sleep(0.1)

    def flush(self) -> None:
        for port in self.primaries():
            self.nodes[port].call(b"FLUSHALL")

    def keys(self, pattern: bytes = b"*") -> dict[int, list[bytes]]:
        """The keys each primary holds."""
        return {p: self.nodes[p].call(b"KEYS", pattern) or [] for p in self.primaries()}

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()
        shutil.rmtree(self.root, ignore_errors=True)
