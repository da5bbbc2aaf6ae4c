"""A disk tier whose filesystem fills up before its budget does (`capacity_bytes` set
larger than the free space, or other users filling a shared filesystem).

Before: once the disk was full, every later store failed (ENOSPC) for the life of the
process, since the budget never asked for an eviction: the tier kept serving the
oldest prefixes and never took a new one. Now a store that finds the disk full evicts
the least recently used entries it knows, worth its own size, and tries once more.

The filesystem here is a fake one (`os.pwritev` and `os.write` refuse bytes past a
limit); `tests/tiers/test_disk.py::test_a_really_full_filesystem` fills a real tmpfs
when it may mount one.
"""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from jax_kvoffload.tiers import DiskTier, DiskTierConfig

from ._helpers import key, payload

NS = bytes(range(32))
N = 60 * 1024  # an entry is 4 KiB + N: 64 KiB on disk


def used_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def tmp_files(path: str) -> list[str]:
    return [f for _, _, fs in os.walk(path) for f in fs if f.endswith(".tmp")]


def fill_and_check(tier: DiskTier, path: str, count: int) -> None:
    """Stores `count` entries one after another (more than fit), then checks that the
    newest ones are served byte for byte and that nothing else is left behind."""
    oks = []
    for i in range(count):
        r = tier.submit_store([(key(i), payload(key(i), N))]).result(timeout=60)
        oks.append(r.ok[0])
    stats = tier.stats()
    assert all(oks[-4:]), f"stores after the disk filled failed: {oks}"
    assert stats.evictions > 0 and stats.bytes_evicted > 0
    newest = list(range(count - 4, count))
    outs = [np.zeros(N, np.uint8) for _ in newest]
    r = tier.submit_load([(key(i), o) for i, o in zip(newest, outs, strict=True)])
    assert r.result(timeout=60).ok == (True,) * 4
    for i, o in zip(newest, outs, strict=True):
        np.testing.assert_array_equal(o, payload(key(i), N))
    assert tmp_files(path) == []
    assert stats.corrupt == 0


@pytest.mark.parametrize("fsync", [True, False])
def test_a_full_disk_evicts_the_oldest_entries_instead_of_refusing_every_store(
    tmp_path, monkeypatch, fsync
):
    path = str(tmp_path / "tier")
    limit = 10 * (N + 4096) + 16 * 1024  # room for 10 entries (and namespace.json)
    real_pwritev, real_write = os.pwritev, os.write

    def room(fd: int, n: int) -> int:
        target = os.readlink(f"/proc/self/fd/{fd}")
        if not target.startswith(path):
            return n
        return max(0, min(n, limit - used_bytes(path)))

    def pwritev(fd, buffers, offset, *args):
        want = sum(len(memoryview(b).cast("B")) for b in buffers)
        fits = room(fd, want)
        if fits == 0 and want:
            raise OSError(errno.ENOSPC, "No space left on device")
        if fits < want:  # a short write, as a filling disk gives
            data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)[:fits]
            return real_pwritev(fd, [data], offset, *args)
        return real_pwritev(fd, buffers, offset, *args)

    def write(fd, data):
        if room(fd, len(data)) < len(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(os, "write", write)
    tier = DiskTier(
        DiskTierConfig(path=path, capacity_bytes=1 << 30, fsync=fsync, direct_io="off"), NS
    )
    try:
        assert tier.wait_rescan(10)
        fill_and_check(tier, path, 24)
        assert used_bytes(path) <= limit
    finally:
        tier.close()
