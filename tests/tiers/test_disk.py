"""DiskTier on real files: round trips, restarts, other processes, damaged files, a full
disk, backpressure, the byte budget and the directory's safety rules."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import threading

import numpy as np
import pytest

from jax_kvoffload.tiers import (
    DiskTier,
    DiskTierConfig,
    TierKeyError,
    UnsafeDirectoryError,
)
from jax_kvoffload.tiers._disk_fs import entry_name

from ._helpers import child_env, key, payload

NS = bytes(range(32))
N = 8192  # payload bytes per entry: small, so the numpy CRC fallback stays quick


def open_disk(path, ns=NS, **kw):
    kw.setdefault("capacity_bytes", 1 << 30)
    return DiskTier(DiskTierConfig(path=path, **kw), ns)


def store(tier, ids, n=N):
    r = tier.submit_store([(key(i), payload(key(i), n)) for i in ids]).result(timeout=30)
    return r


def load(tier, ids, n=N):
    outs = [np.full(n, 0xAA, np.uint8) for _ in ids]
    r = tier.submit_load([(key(i), o) for i, o in zip(ids, outs)]).result(timeout=30)
    for i, o, ok in zip(ids, outs, r.ok):
        if ok:  # a hit is exactly the stored bytes
            np.testing.assert_array_equal(o, payload(key(i), n))
    return list(r.ok)


def entry_path(root, k, ns=NS):
    shard, name = entry_name(ns, k)
    return os.path.join(root, ns[:8].hex(), shard, name)


def test_round_trip_and_already_present(disk):
    r = store(disk, range(5))
    assert r.all_ok and r.nbytes == 5 * N and r.kind == "store"
    assert disk.contains([key(0), key(4), key(99)]) == [True, True, False]
    assert load(disk, [4, 99, 0]) == [True, False, True]
    again = store(disk, [0, 1])
    assert again.all_ok and again.nbytes == 0  # "already exists" is success, nothing written
    s = disk.stats()
    assert (s.keys_stored, s.keys_already_present, s.load_hits, s.load_misses) == (7, 2, 2, 1)
    assert disk.medium == "disk"
    assert (s.entries, s.corrupt, s.errors) == (5, 0, 0)


def test_files_are_private_and_sharded(disk, tier_path):
    store(disk, [1])
    p = entry_path(tier_path, key(1))
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    d = os.path.dirname(p)
    while d != os.path.dirname(tier_path):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
        d = os.path.dirname(d)
    assert len(os.path.basename(os.path.dirname(p))) == 2  # <ns>/<shard>/<name>
    assert os.path.dirname(os.path.dirname(p)) == os.path.join(tier_path, NS[:8].hex())


def test_restart_reuses_entries_and_keeps_lru_order(tier_path):
    tier = open_disk(tier_path, capacity_bytes=10 * (N + 4096))
    store(tier, range(6))
    assert load(tier, [0, 1]) == [True, True]  # 0 and 1 now most recent; 2 is the LRU
    tier.close()
    # Recency lives in file mtimes; make it unambiguous on coarse-clock filesystems.
    for rank, i in enumerate([2, 3, 4, 5, 0, 1]):
        os.utime(entry_path(tier_path, key(i)), (1e9 + rank, 1e9 + rank))
    tier = open_disk(tier_path, capacity_bytes=6 * (N + 4096))
    assert tier.wait_rescan(10)
    assert tier.stats().entries == 6
    store(tier, [10, 11])  # two over the budget: the two least recent of the last run go
    assert tier.contains([key(i) for i in (2, 3, 4, 5, 0, 1, 10, 11)]) == [
        False,
        False,
        True,
        True,
        True,
        True,
        True,
        True,
    ]
    assert tier.stats().evictions == 2
    assert load(tier, [0, 1, 4, 5]) == [True] * 4
    tier.close()


CHILD = """
import sys, numpy as np
from tests.tiers._helpers import key, payload
from jax_kvoffload.tiers import DiskTier, DiskTierConfig
tier = DiskTier(DiskTierConfig(path=sys.argv[1], capacity_bytes=1 << 30), bytes(range(32)))
ids = [int(x) for x in sys.argv[3].split(",")]
if sys.argv[2] == "store":
    r = tier.submit_store([(key(i), payload(key(i), 8192)) for i in ids]).result()
else:
    outs = [np.zeros(8192, np.uint8) for _ in ids]
    r = tier.submit_load([(key(i), o) for i, o in zip(ids, outs)]).result()
    assert all((o == payload(key(i), 8192)).all() for i, o, ok in zip(ids, outs, r.ok) if ok)
tier.close()
print(",".join(str(int(ok)) for ok in r.ok))
"""


def run_child(*args):
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=child_env()["PYTHONPATH"].split(os.pathsep)[0],
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_another_process_reads_what_this_one_stored_and_back(disk, tier_path):
    store(disk, [1, 2])
    assert run_child(tier_path, "load", "1,2,3") == "1,1,0"
    assert run_child(tier_path, "store", "3,4") == "1,1"
    assert load(disk, [3, 4]) == [True, True]
    assert disk.stats().entries == 4  # the other process's entries joined the index on read


def damage_payload(p):
    with open(p, "r+b") as f:
        f.seek(4096 + 100)
        b = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([b[0] ^ 1]))


def damage_header(p):
    with open(p, "r+b") as f:
        f.seek(20)  # inside the namespace field
        f.write(b"\xff")


def truncate(p):
    os.truncate(p, os.path.getsize(p) - 1)


def truncate_to_header(p):
    os.truncate(p, 4096)


def empty(p):
    os.truncate(p, 0)


@pytest.mark.parametrize(
    "damage", [damage_payload, damage_header, truncate, truncate_to_header, empty]
)
def test_a_damaged_file_is_a_miss_and_is_removed(disk, tier_path, damage):
    store(disk, [1, 2, 3])
    damage(entry_path(tier_path, key(2)))
    assert load(disk, [1, 2, 3]) == [True, False, True]
    assert not os.path.exists(entry_path(tier_path, key(2)))
    assert disk.stats().corrupt == 1
    assert store(disk, [2]).all_ok and load(disk, [2]) == [True]  # stored anew


def test_an_entry_of_another_key_or_namespace_in_place_is_a_miss(disk, tier_path):
    store(disk, [1, 2])
    os.replace(entry_path(tier_path, key(1)), entry_path(tier_path, key(2)))
    assert load(disk, [2]) == [False]
    other = open_disk(tier_path, ns=bytes(32))
    try:
        assert other.contains([key(1), key(2)]) == [False, False]  # another namespace
        store(other, [5])
        src = entry_path(tier_path, key(5), bytes(32))
        dst = entry_path(tier_path, key(5))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.link(src, dst)  # the other namespace's bytes where ours would be
        assert load(disk, [5]) == [False]
        assert load(other, [5]) == [True]
    finally:
        other.close()


def test_a_link_in_place_of_an_entry_is_never_followed(disk, tier_path, tmp_path):
    store(disk, [1])
    target = tmp_path / "elsewhere"
    with open(entry_path(tier_path, key(1)), "rb") as f:
        target.write_bytes(f.read())
    os.unlink(entry_path(tier_path, key(1)))
    os.symlink(target, entry_path(tier_path, key(1)))
    assert load(disk, [1]) == [False]
    assert target.exists()  # the link is removed, never what it points to


def test_unsafe_directories_are_refused(tmp_path):
    open_mode = tmp_path / "open"
    open_mode.mkdir(mode=0o755)
    os.chmod(open_mode, 0o755)
    with pytest.raises(UnsafeDirectoryError, match="chmod 700"):
        open_disk(str(open_mode))
    link = tmp_path / "link"
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link.symlink_to(real)
    with pytest.raises(UnsafeDirectoryError, match="symbolic link"):
        open_disk(str(link))
    if os.geteuid() == 0:  # only root can give a directory away
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(UnsafeDirectoryError, match="owned by uid 65534"):
            open_disk(str(theirs))


def test_budget_evicts_least_recently_used(tier_path):
    tier = open_disk(tier_path, capacity_bytes=3 * (N + 4096))
    try:
        for i in (1, 2, 3):  # one job each: a job's keys are written in parallel
            store(tier, [i])
        assert load(tier, [1]) == [True]  # order is now 2, 3, 1 — storing 4 evicts 2
        store(tier, [4])
        assert tier.contains([key(i) for i in (1, 2, 3, 4)]) == [True, False, True, True]
        s = tier.stats()
        assert (s.evictions, s.entries) == (1, 3) and s.bytes_used <= 3 * (N + 4096)
        big = tier.submit_store([(key(9), np.zeros(5 * N, np.uint8))]).result()
        assert big.ok == (False,)  # larger than the whole budget: refused, nothing evicted
        assert tier.stats().entries == 3
    finally:
        tier.close()


def test_stores_are_dropped_when_the_disk_falls_behind(tier_path, monkeypatch):
    tier = open_disk(tier_path, write_threads=1, max_pending_store_bytes=2 * N)
    gate = threading.Event()
    real = tier._store_one

    def slow(*a):
        gate.wait(10)
        return real(*a)

    monkeypatch.setattr(tier, "_store_one", slow)
    try:
        first = tier.submit_store([(key(1), payload(key(1), N))])
        second = tier.submit_store([(key(2), payload(key(2), N)), (key(3), payload(key(3), N))])
        assert second.done() and second.result().dropped  # no wait: dropped, counted
        assert load(tier, [7]) == [False]  # loads do not queue behind the stuck store
        gate.set()
        assert first.result(10).all_ok
        s = tier.stats()
        assert (s.stores_dropped, s.keys_dropped) == (1, 2)
    finally:
        gate.set()
        tier.close()


def test_disk_full_fails_the_store_and_leaves_no_file(disk, tier_path, monkeypatch):
    store(disk, [1])
    real = os.pwritev

    def full(fd, bufs, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    r = store(disk, [2, 3])
    assert r.ok == (False, False)
    monkeypatch.setattr(os, "pwritev", real)
    leaf_files = [f for _, _, fs in os.walk(tier_path) for f in fs if f.endswith(".tmp")]
    assert leaf_files == []
    assert disk.contains([key(2)]) == [False]
    s = disk.stats()
    assert (s.store_failures, s.errors) == (2, 2)
    # Each refused write first made room (the oldest entry, the only one) and tried
    # once more: on a real disk that retry succeeds (tests/tiers/test_disk_full.py).
    assert (s.evictions, load(disk, [1])) == (1, [False])
    assert store(disk, [2]).all_ok  # space again: stores work again


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tiny tmpfs needs root")
def test_a_really_full_filesystem(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir(mode=0o700)
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (no privilege in this container)")
    try:
        tier = open_disk(str(mnt / "t"), direct_io="auto")  # older kernels' tmpfs: buffered
        try:
            oks = [store(tier, [i], n=32 * 1024).all_ok for i in range(12)]
            # Full after ~6 entries: each later store evicts the oldest to make room.
            assert all(oks) and tier.stats().evictions >= 1
            assert load(tier, [10, 11], n=32 * 1024) == [True, True]
            leftovers = [f for _, _, fs in os.walk(mnt) for f in fs if f.endswith(".tmp")]
            assert leftovers == []
        finally:
            tier.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.parametrize("direct_io", ["off", "auto"])
def test_concurrent_writers_and_readers_never_see_wrong_bytes(tier_path, direct_io):
    tier = open_disk(tier_path, direct_io=direct_io, read_threads=3, write_threads=3)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(15):
                ids = [int(i) for i in rng.choice(20, 3, replace=False)]
                store(tier, ids)
                load(tier, [int(i) for i in rng.choice(20, 4, replace=False)])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert errors == []
        assert tier.stats().corrupt == 0 and tier.stats().errors == 0
    finally:
        tier.close()


def test_bad_arguments_raise_at_once(disk):
    with pytest.raises(TierKeyError, match="twice"):
        disk.submit_store([(key(1), b"a"), (key(1), b"b")])
    with pytest.raises(TierKeyError, match="writable"):
        disk.submit_load([(key(1), b"abc")])
    with pytest.raises(TierKeyError, match=r"keys are 1\.\.1024"):
        disk.contains([b""])
    with pytest.raises(TierKeyError, match="wrap it in a list"):
        disk.contains(key(1))


def test_direct_io_on_where_the_filesystem_refuses_it(tier_path, monkeypatch):
    from jax_kvoffload.tiers import DirectIOUnavailableError, _disk

    monkeypatch.setattr(_disk, "probe_direct_io", lambda fd: False)
    with pytest.raises(DirectIOUnavailableError, match="direct_io='auto'"):
        open_disk(tier_path, direct_io="on")
    tier = open_disk(tier_path, direct_io="auto")  # the fallback: buffered, same format
    try:
        assert not tier.direct_io
        assert store(tier, [1]).all_ok and load(tier, [1]) == [True]
    finally:
        tier.close()


def test_async_lookup_drain_and_close_report_every_job(tier_path, monkeypatch):
    from jax_kvoffload.tiers import TierClosedError

    tier = open_disk(tier_path, write_threads=1)
    store(tier, [1])
    assert tier.lookup_async([key(1), key(2)]).result(10) == [True, False]
    gate = threading.Event()
    real = tier._store_one

    def slow(*a):
        gate.wait(10)
        return real(*a)

    monkeypatch.setattr(tier, "_store_one", slow)
    running = tier.submit_store([(key(2), payload(key(2), N))])
    queued = tier.submit_store([(key(3), payload(key(3), N))])
    assert not tier.drain(timeout=0.05)  # bounded: says it timed out
    threading.Timer(0.2, gate.set).start()
    tier.close()  # the running store finishes; the queued one fails; both are reported
    assert running.result(0).all_ok
    assert queued.result(0).ok == (False,) and not queued.result(0).dropped
    with pytest.raises(TierClosedError, match="closed"):
        tier.submit_load([(key(1), np.zeros(N, np.uint8))])
    tier.close()  # idempotent


def test_processes_writing_the_same_keys_while_one_reads(disk, tier_path):
    root = child_env()["PYTHONPATH"].split(os.pathsep)[0]
    ids = ",".join(str(i) for i in range(40))
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, tier_path, "store", ids],
            env=child_env(),
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    seen = 0
    while any(w.poll() is None for w in writers):
        seen += sum(load(disk, list(range(0, 40, 7))))  # hits are checked byte for byte
    for w in writers:
        out, err = w.communicate(timeout=120)
        assert w.returncode == 0, err
        assert out.strip().splitlines()[-1] == ",".join(["1"] * 40)
    assert load(disk, list(range(40))) == [True] * 40
    assert disk.stats().corrupt == 0
    assert [f for _, _, fs in os.walk(tier_path) for f in fs if f.endswith(".tmp")] == []
