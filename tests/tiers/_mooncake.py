"""A private Mooncake Store on loopback for the tests: `mooncake_master` (with its HTTP
metadata server) and storage nodes (`mooncake_client`, each mounting a segment), on
free ports, stopped at the end; a raw client of Mooncake's own beside the tier's.

The binaries ship in Mooncake's wheel (`mooncake-transfer-engine-non-cuda`); without
it (or its libraries: libibverbs1, librdmacm1, libnuma1) `NO_MOONCAKE` says why.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import subprocess
import tempfile
import time

from ._helpers import _DIE_WITH_PARENT, free_port


def _why_not() -> str | None:
    spec = importlib.util.find_spec("mooncake")
    if spec is None:
        return (
            "Mooncake is not installed (pip install mooncake-transfer-engine-non-cuda=="
            "0.3.13.post1; apt-get install libibverbs1 librdmacm1 libnuma1); .ci/run does"
        )
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"Mooncake does not import ({e}); apt-get install libibverbs1 librdmacm1 libnuma1"
    return None


NO_MOONCAKE = _why_not()
BIN = os.path.dirname(importlib.util.find_spec("mooncake").origin) if NO_MOONCAKE is None else None


class MooncakeStore:
    """A master and `nodes` storage nodes of `segment` bytes each, on loopback.

    `master_flags` are extra `mooncake_master` flags (`--client_ttl=3`, eviction
    watermarks). `raw` is a Mooncake client of this process (16 MiB local buffer)."""

    def __init__(self, nodes: int = 1, segment: str = "256MB", master_flags: tuple = ()):
        self.dir = tempfile.mkdtemp(prefix="jkv-mooncake-")
        self.port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.master_flags = tuple(master_flags)
        self.segment = segment
        self.master = None
        self.nodes: list[subprocess.Popen | None] = []
        self.node_ports: list[int] = []
        self.raw = None
        try:
            self.start_master()
            for _ in range(nodes):
                self.add_node()
            self.raw = self.client(buffer=16 << 20)
            self.wait_writable()
        except BaseException:
            self.stop()
            raise

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def options(self) -> dict:
        """The tier's `secondary_tiers` keys for this store."""
        return {
            "master_server_address": self.master_address,
            "metadata_server": self.metadata_server,
            "local_hostname": "127.0.0.1",
        }

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.dir, f"{name}.log"), "ab")  # noqa: SIM115 (the child's)
        try:
            return subprocess.Popen(
                [*_DIE_WITH_PARENT, os.path.join(BIN, name), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.dir,
            )
        finally:
            log.close()

    def start_master(self) -> None:
        self.master = self._spawn(
            "mooncake_master",
            [
                f"--port={self.port}",
                "--rpc_address=127.0.0.1",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
                *self.master_flags,
            ],
        )
        self._wait_port(self.port, self.master)
        self._wait_port(self.http_port, self.master)

    def add_node(self, segment: str | None = None) -> int:
        """Starts a storage node mounting a segment; returns its index."""
        port = free_port()
        proc = self._spawn(
            "mooncake_client",
            [
                f"--global_segment_size={segment or self.segment}",
                "--host=127.0.0.1",
                f"--port={port}",
                f"--master_server_address={self.master_address}",
                f"--metadata_server={self.metadata_server}",
            ],
        )
        self.nodes.append(proc)
        self.node_ports.append(port)
        self._wait_port(port, proc)
        return len(self.nodes) - 1

    def _wait_port(self, port: int, proc: subprocess.Popen, timeout: float = 20) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                return
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"a Mooncake process did not listen on {port}: {self.logs()}")
            time.sleep(0.05)

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.dir)):
            with open(os.path.join(self.dir, name), "rb") as f:
                out.append(f"--- {name}\n" + f.read()[-2000:].decode(errors="replace"))
        return "\n".join(out)

    def client(self, buffer: int = 0, segment: int = 0):
        """A fresh Mooncake client of this process (`close()` it)."""
        from mooncake.store import MooncakeDistributedStore

        c = MooncakeDistributedStore()
        rc = c.setup(
            "127.0.0.1", self.metadata_server, segment, buffer, "tcp", "", self.master_address
        )
        assert rc == 0, f"setup returned {rc}: {self.logs()}"
        return c

    def wait_writable(self, timeout: float = 20) -> None:
        """Until a put succeeds (the nodes' segments are mounted)."""
        deadline = time.monotonic() + timeout
        while self.raw.put("jkv-test:probe", b"x") != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Mooncake store takes no put: {self.logs()}")
            time.sleep(0.1)
        self.raw.remove("jkv-test:probe", True)

    def kill_master(self) -> None:
        self.master.kill()
        self.master.wait()

    def kill_node(self, i: int) -> None:
        self.nodes[i].kill()
        self.nodes[i].wait()

    def pause_node(self, i: int) -> None:
        self.nodes[i].send_signal(signal.SIGSTOP)

    def resume_node(self, i: int) -> None:
        self.nodes[i].send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.raw is not None:
            self.raw.close()
            self.raw = None
        for proc in [*self.nodes, self.master]:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in [*self.nodes, self.master]:
            if proc is None:
                continue
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
