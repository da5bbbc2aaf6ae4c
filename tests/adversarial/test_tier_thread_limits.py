"""A tier opened in a process out of threads (`RuntimeError: can't start new thread`,
e.g. under a container's pids limit) at each of the threads it starts.

Before: the raw RuntimeError left the constructor, and the threads already started
(the syncer, the I/O threads) and the directory descriptors stayed for the life of
the process. Now: a `TierStateError` that says so, and nothing left behind."""

from __future__ import annotations

import os
import threading
import time

import pytest

from jax_kvoffload.errors import KVOffloadStateError
from jax_kvoffload.tiers import DiskTier, DiskTierConfig, RedisTier, RedisTierConfig, TierStateError

NS = bytes(range(32))


def tier_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(("disk-tier", "redis-tier"))}


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def failing_start(monkeypatch):
    """`fail(fragment)`: starting a thread whose name contains `fragment` raises."""
    real = threading.Thread.start
    fragment: list[str] = []

    def start(self):
        if fragment and fragment[0] in self.name:
            raise RuntimeError("can't start new thread")
        return real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    return fragment.append


def check_nothing_left(before_threads, before_fds):
    deadline = time.monotonic() + 10
    while tier_threads() - before_threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not tier_threads() - before_threads
    assert open_fds() == before_fds


@pytest.mark.parametrize("fragment", ["-sync", "-load0", "-load1", "-store0", "-store1", "rescan"])
def test_a_disk_tier_that_cannot_start_a_thread_leaves_nothing(tmp_path, failing_start, fragment):
    cfg = DiskTierConfig(path=str(tmp_path / "t"), capacity_bytes=1 << 20,
                         read_threads=2, write_threads=2)  # fmt: skip
    DiskTier(cfg, NS).close()  # the directory exists: only threads and descriptors remain
    threads, fds = tier_threads(), open_fds()
    failing_start(fragment)
    with pytest.raises(TierStateError, match="thread") as info:
        DiskTier(cfg, NS)
    assert isinstance(info.value, KVOffloadStateError)
    check_nothing_left(threads, fds)


@pytest.mark.parametrize("fragment", ["-load0", "-store1"])
def test_a_redis_tier_that_cannot_start_a_thread_leaves_nothing(failing_start, fragment):
    cfg = RedisTierConfig(url="redis://127.0.0.1:1/0", read_connections=2, write_connections=2)
    threads, fds = tier_threads(), open_fds()
    failing_start(fragment)
    with pytest.raises(TierStateError, match="thread"):
        RedisTier(cfg, NS)
    check_nothing_left(threads, fds)
