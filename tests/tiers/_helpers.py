"""Shared helpers of the tier tests: keys, payloads that name their key, a Redis server."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from jax_kvoffload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

REDIS_SERVER = shutil.which("redis-server")
NO_REDIS = "redis-server is not installed (apt-get install redis-server); .ci/run installs it"


def key(i: int, group: int = 0) -> bytes:
    """A 36-byte offload key: a sha256 'block hash' of `i` plus the group index."""
    return hashlib.sha256(str(i).encode()).digest() + group.to_bytes(4, "big")


def payload(k: bytes, n: int) -> np.ndarray:
    """`n` bytes determined by the key alone: any process can check a hit byte for byte."""
    seed = int.from_bytes(hashlib.sha256(k).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def offloading_config(**changes) -> OffloadingConfig:
    """A small boundary; keyword arguments replace `model`, `dtype`, `tp`, ... fields."""
    tp = changes.get("tp", 1)
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("l0", "l1"), 0),),
        worker_kv_bytes_per_block=changes.get("wkb", 4096 // tp),
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="e0",
        model=OffloadingModelConfig(changes.get("model", "m"), changes.get("dtype", "bfloat16")),
        cache=OffloadingCacheConfig(16, changes.get("bpc", 1)),
        parallel=OffloadingParallelConfig(
            0, tp, tp, 1, 1, 1, 0, 1, None, changes.get("agnostic", False)
        ),
        replicated_layout=changes.get("replicated", False),
        canonical_layout=changes.get("canonical", False),
        kv_cache_layout=changes.get("layout", "LBNHC"),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Servers die with the test process (SIGKILL on its death: PR_SET_PDEATHSIG), so a
# crashed or killed test run leaves none behind. Set by util-linux's setpriv before it
# execs the server: a preexec_fn would fork the (multithreaded, JAX-holding) interpreter.
# The signal follows the thread that started the server: start servers on the main one.
_SETPRIV = shutil.which("setpriv")
_DIE_WITH_PARENT = [_SETPRIV, "--pdeathsig", "KILL", "--"] if _SETPRIV else []


class RedisServer:
    """A private redis-server on a free loopback port; `stop()` ends it."""

    def __init__(
        self,
        *args: str,
        maxmemory: str = "64mb",
        policy: str = "allkeys-lru",
        port: int = 0,
        parent: str | None = None,
    ):
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="jkv-redis-", dir=parent)
        cmd = [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            maxmemory,
            "--maxmemory-policy",
            policy,
            "--dir",
            self.dir,
            "--loglevel",
            "warning",
            *args,
        ]
        self.cmd = cmd
        self.password = None  # what call() authenticates with
        self.tls = None  # and the ssl.SSLContext it connects with
        self.start()

    def start(self) -> None:
        """Starts the server (again, after `kill()`: same port, same directory)."""
        self.proc = subprocess.Popen(
            [*_DIE_WITH_PARENT, *self.cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 10
        while True:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 0.2),
            ):
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                self.stop()
                raise RuntimeError(f"redis-server did not start: {err}")
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL, as a crash: the directory (a cluster node's nodes.conf) stays."""
        self.proc.kill()
        self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def call(self, *args: bytes):
        """One command over a fresh connection of our own client."""
        from jax_kvoffload.tiers._resp import Endpoint, RespConnection

        conn = RespConnection(
            Endpoint("127.0.0.1", self.port, None, 0, None, self.password, self.tls, None, 2.0, 5.0)
        )
        conn.connect()
        try:
            return conn.call(*args)
        finally:
            conn.close()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def child_env() -> dict[str, str]:
    """The environment of a child Python process that imports this checkout."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_child(code: str, *argv: str) -> subprocess.CompletedProcess:
    """`python -c code argv...` in a child that imports this checkout, from its root."""
    env = child_env()
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        env=env,
        cwd=env["PYTHONPATH"].split(os.pathsep)[0],
        capture_output=True,
        text=True,
        timeout=120,
    )
