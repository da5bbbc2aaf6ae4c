"""The disk tier's layout and its batched fsyncs: shards made once and bounded,
descriptors bounded, a store reported only once durable, failures of each barrier, the
restart scan over every shard."""

from __future__ import annotations

import concurrent.futures as cf
import errno
import os
import shutil
import stat
import threading
import time

import numpy as np
import pytest

from jax_kvoffload.tiers import DiskTier, DiskTierConfig, UnsafeDirectoryError, _disk_sync
from jax_kvoffload.tiers._disk_fs import SHARDS, entry_name

from ._helpers import key, payload

NS = bytes(range(32))
N = 4096


def open_disk(path, **kw):
    kw.setdefault("capacity_bytes", 1 << 30)
    return DiskTier(DiskTierConfig(path=path, **kw), NS)


def store(tier, ids, n=N):
    return tier.submit_store([(key(i), payload(key(i), n)) for i in ids]).result(timeout=60)


def loads(tier, ids, n=N):
    outs = [np.zeros(n, np.uint8) for _ in ids]
    r = tier.submit_load([(key(i), o) for i, o in zip(ids, outs)]).result(timeout=60)
    for i, o, ok in zip(ids, outs, r.ok):
        if ok:
            np.testing.assert_array_equal(o, payload(key(i), n))
    return list(r.ok)


def ns_dir(path):
    return os.path.join(path, NS[:8].hex())


def shard_dirs(path):
    with os.scandir(ns_dir(path)) as it:
        return sorted(e.name for e in it if e.is_dir(follow_symlinks=False))


def tmp_files(path):
    return [f for _, _, fs in os.walk(path) for f in fs if f.endswith(".tmp")]


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def test_shards_are_made_once_and_stay_bounded(tier_path, monkeypatch):
    tier = open_disk(tier_path, fsync=False)
    try:
        assert shard_dirs(tier_path) == [f"{i:02x}" for i in range(SHARDS)]
        for d in shard_dirs(tier_path):
            mode = os.stat(os.path.join(ns_dir(tier_path), d), follow_symlinks=False).st_mode
            assert stat.S_IMODE(mode) == 0o700
        made = []
        real = os.mkdir
        monkeypatch.setattr(os, "mkdir", lambda *a, **kw: (made.append(a), real(*a, **kw)))
        assert store(tier, range(600)).all_ok  # > 2 entries per shard on average
        assert made == []  # no directory per entry (the layout before made two)
        assert len(shard_dirs(tier_path)) == SHARDS
        files = [f for _, _, fs in os.walk(ns_dir(tier_path)) for f in fs]
        assert len(files) == 600 and all(f.endswith(".kv") for f in files)
    finally:
        tier.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
@pytest.mark.parametrize("syncfs", ["auto", None])
def test_descriptors_stay_bounded_while_storing_and_loading(tier_path, monkeypatch, syncfs):
    if syncfs is None:
        monkeypatch.setattr(_disk_sync, "SYNCFS", None)
    before = open_fds()
    tier = open_disk(tier_path, read_threads=3, write_threads=3)
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], open_fds())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        jobs = [tier.submit_store([(key(i), payload(key(i), N))]) for i in range(300)]
        assert all(f.result(60).all_ok for f in jobs)
        assert loads(tier, range(300)) == [True] * 300
    finally:
        stop.set()
        sampler.join()
        tier.close()
    # root + namespace, one file per I/O thread, one directory for the syncer, and the
    # listing of /proc/self/fd itself: whatever the number of entries.
    assert peak[0] - before <= 2 + 3 + 3 + 1 + 1, peak[0] - before
    assert open_fds() <= before


def test_a_store_is_reported_after_its_bytes_and_its_name_are_durable(tmp_path, monkeypatch):
    """The order of the batch: barrier, rename, barrier, report (a fake syncfs watches)."""
    monkeypatch.setattr(_disk_sync, "SYNCFS_MIN_FILES", 1)
    ns = tmp_path / "ns"
    (ns / "00").mkdir(parents=True)
    seen, gate = [], threading.Event()
    futures: dict[str, cf.Future] = {}

    def syncfs(fd):
        gate.wait(10)
        finals = sorted(f for f in os.listdir(ns / "00") if not f.startswith("."))
        seen.append((finals, sorted(n for n, f in futures.items() if f.done())))

    fd = os.open(ns, os.O_RDONLY | os.O_DIRECTORY)
    syncer = _disk_sync.Syncer(fd, "test-sync", syncfs=syncfs)
    try:
        for name in ("a", "b"):
            (ns / "00" / f".{name}.tmp").write_bytes(b"x")
        futures["a"] = syncer.submit("00", ".a.tmp", "a")
        time.sleep(0.05)  # the syncer takes [a] alone and waits in its first barrier
        futures["b"] = syncer.submit("00", ".b.tmp", "b")
        gate.set()
        assert futures["a"].result(10) is None and futures["b"].result(10) is None
    finally:
        syncer.close()
        os.close(fd)
    assert seen == [
        ([], []),  # a's bytes made durable before its name appears
        (["a"], []),  # a renamed, made durable, still not reported
        (["a"], ["a"]),  # then a reported; b's bytes durable before b appears
        (["a", "b"], ["a"]),
    ]
    assert sorted(os.listdir(ns / "00")) == ["a", "b"]


@pytest.mark.parametrize("failing", ["first", "second"])
def test_a_failed_barrier_fails_its_stores(tier_path, monkeypatch, failing):
    calls = []

    def syncfs(fd):
        calls.append(fd)
        if (len(calls) % 2 == 1) == (failing == "first"):
            raise OSError(errno.EIO, "syncfs: Input/output error")

    monkeypatch.setattr(_disk_sync, "SYNCFS", syncfs)
    monkeypatch.setattr(_disk_sync, "SYNCFS_MIN_FILES", 1)
    tier = open_disk(tier_path, write_threads=1)
    try:
        r = store(tier, [1])
        assert r.ok == (False,)
        s = tier.stats()
        assert (s.keys_stored, s.store_failures, s.errors) == (0, 1, 1)
        assert tmp_files(tier_path) == []
        if failing == "first":  # nothing renamed: no entry
            assert tier.contains([key(1)]) == [False]
        else:  # renamed, durability unknown: reported failed, but a whole, checked entry
            assert loads(tier, [1]) == [True]
        monkeypatch.setattr(tier._syncer, "_syncfs", None)  # the disk is well again
        assert store(tier, [2]).all_ok and loads(tier, [2]) == [True]
    finally:
        tier.close()


def test_without_syncfs_each_file_and_each_directory_is_fsynced(tier_path, monkeypatch):
    monkeypatch.setattr(_disk_sync, "SYNCFS", None)
    synced, dirs = [], []
    real_fdatasync, real_fsync = os.fdatasync, os.fsync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real_fdatasync(fd)))
    monkeypatch.setattr(os, "fsync", lambda fd: (dirs.append(fd), real_fsync(fd)))
    tier = open_disk(tier_path)
    try:
        del synced[:], dirs[:]  # opening fsyncs the new directories once
        assert store(tier, range(10)).all_ok
        assert len(synced) == 10 and 1 <= len(dirs) <= 10
        assert loads(tier, range(10)) == [True] * 10
    finally:
        tier.close()


def test_close_completes_the_stores_waiting_for_the_syncer(tier_path, monkeypatch):
    gate = threading.Event()
    monkeypatch.setattr(_disk_sync, "SYNCFS", lambda fd: gate.wait(10))
    monkeypatch.setattr(_disk_sync, "SYNCFS_MIN_FILES", 1)
    tier = open_disk(tier_path, write_threads=2)
    jobs = [tier.submit_store([(key(i), payload(key(i), N))]) for i in range(6)]
    deadline = time.monotonic() + 10
    while len(tmp_files(tier_path)) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)  # every entry written; the syncer holds them all
    time.sleep(0.05)
    assert not any(f.done() for f in jobs)
    threading.Timer(0.2, gate.set).start()
    tier.close()
    assert all(f.result(0).all_ok for f in jobs)
    tier = open_disk(tier_path)
    try:
        assert loads(tier, range(6)) == [True] * 6
    finally:
        tier.close()


def test_a_removed_shard_is_made_again(disk, tier_path):
    assert store(disk, [1]).all_ok
    shard, _ = entry_name(NS, key(2))
    shutil.rmtree(os.path.join(ns_dir(tier_path), shard))  # an operator cleaning up
    assert store(disk, [2]).all_ok and loads(disk, [1, 2])[1] is True
    assert len(shard_dirs(tier_path)) == SHARDS


def test_a_shard_that_is_a_link_or_reachable_by_others_is_refused(tier_path, tmp_path):
    open_disk(tier_path).close()
    shard = os.path.join(ns_dir(tier_path), "7f")
    os.chmod(shard, 0o755)
    with pytest.raises(UnsafeDirectoryError, match="chmod 700"):
        open_disk(tier_path)
    os.rmdir(shard)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, shard)
    with pytest.raises(UnsafeDirectoryError, match="not a directory we made"):
        open_disk(tier_path)


def test_restart_scan_finds_the_entries_of_every_shard(tier_path):
    tier = open_disk(tier_path, fsync=False)
    assert store(tier, range(700)).all_ok
    used = tier.stats().bytes_used
    tier.close()
    # A leaf of the pre-release two-level layout (<ns>/<aa>/<bb>/<name>.kv): not ours now.
    old = os.path.join(ns_dir(tier_path), "ab", "cd")
    os.makedirs(old, mode=0o700)
    with open(os.path.join(old, "0" * 40 + ".kv"), "wb") as f:
        f.write(b"\0" * 8192)
    tier = open_disk(tier_path)
    try:
        assert tier.wait_rescan(30)
        s = tier.stats()
        assert (s.entries, s.bytes_used) == (700, used)
        assert loads(tier, [0, 350, 699]) == [True] * 3
    finally:
        tier.close()


def test_a_scan_cut_short_still_serves_every_entry(tier_path):
    tier = open_disk(tier_path, fsync=False)
    assert store(tier, range(50)).all_ok
    tier.close()
    tier = open_disk(tier_path, rescan_timeout_s=1e-9)
    try:
        assert tier.wait_rescan(10)
        assert tier.stats().entries < 50  # the deadline passed before the first shard
        assert loads(tier, range(50)) == [True] * 50  # lookups ask the filesystem
        assert tier.stats().entries == 50  # and hits join the index
    finally:
        tier.close()


def test_a_failing_deferred_store_fails_its_keys_and_the_thread_lives(disk, monkeypatch):
    real = DiskTier._store_one

    def broken(self, *args):
        f = cf.Future()
        f.set_exception(RuntimeError("injected"))
        return f

    monkeypatch.setattr(DiskTier, "_store_one", broken)
    assert store(disk, [1]).ok == (False,)
    assert disk.stats().errors == 1
    monkeypatch.setattr(DiskTier, "_store_one", real)
    assert store(disk, [2]).all_ok and disk.drain(5)


def test_a_bug_in_the_syncer_fails_its_batch_and_it_serves_the_next(tier_path, monkeypatch):
    calls = []

    def syncfs(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise RuntimeError("injected bug")

    monkeypatch.setattr(_disk_sync, "SYNCFS", syncfs)
    monkeypatch.setattr(_disk_sync, "SYNCFS_MIN_FILES", 1)
    tier = open_disk(tier_path, write_threads=1)
    try:
        assert store(tier, [1]).ok == (False,)  # logged with its traceback by the runner
        assert tier.stats().errors == 1 and tier.drain(5)
        assert tmp_files(tier_path) == []
        assert store(tier, [2]).all_ok and loads(tier, [2]) == [True]
    finally:
        tier.close()


@pytest.mark.parametrize("removed", ["root", "namespace"])
def test_a_tier_directory_removed_under_the_tier_says_so(tier_path, caplog, removed):
    # Before: "store failed: [Errno 2] No such file or directory: '00'" (a shard's name),
    # nothing telling the operator that the directory is gone and the tier must be
    # reopened. Stores fail and loads miss either way (counted, no exception).
    import logging

    tier = DiskTier(DiskTierConfig(path=tier_path, capacity_bytes=1 << 30), NS)
    try:
        assert tier.submit_store([(key(1), payload(key(1), 4096))]).result(30).all_ok
        gone = tier_path if removed == "root" else os.path.join(tier_path, NS[:8].hex())
        shutil.rmtree(gone)
        caplog.set_level(logging.WARNING, logger="jax_kvoffload.tiers._disk")
        r = tier.submit_store([(key(2), payload(key(2), 4096))]).result(30)
        assert r.ok == (False,) and tier.stats().store_failures == 1
        out = np.zeros(4096, np.uint8)
        assert tier.submit_load([(key(1), out)]).result(30).ok == (False,)
        text = caplog.text
        assert "was removed while the tier runs" in text and "reopen" in text, text
    finally:
        tier.close()
