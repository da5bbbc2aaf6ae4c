"""The disk tier attacked as a careless caller, a careless operator and a failing disk
would: a load buffer of the wrong size, a write-back error that a failed syncfs reported
for another batch's file, temporary files left by an earlier process with this pid, an
index that outlived files another process removed, two tiers racing on one directory."""

from __future__ import annotations

import concurrent.futures as cf
import errno
import os
import random
import threading
import time

import numpy as np
import pytest

from jax_kvoffload.errors import KVOffloadValueError
from jax_kvoffload.tiers import (
    DiskTier,
    DiskTierConfig,
    TierBufferSizeError,
    TierKeyError,
    _disk_index,
    _disk_sync,
)
from jax_kvoffload.tiers._disk_fs import entry_name, process_token

from ._helpers import key, payload

NS = bytes(range(32))
N = 8192


def open_disk(path, **kw):
    kw.setdefault("capacity_bytes", 1 << 30)
    return DiskTier(DiskTierConfig(path=path, **kw), NS)


def store(tier, ids, n=N):
    return tier.submit_store([(key(i), payload(key(i), n)) for i in ids]).result(timeout=60)


def entry_path(path, i):
    shard, name = entry_name(NS, key(i))
    return os.path.join(path, NS[:8].hex(), shard, name)


def tmp_files(path):
    return sorted(f for _, _, fs in os.walk(path) for f in fs if f.endswith(".tmp"))


# ---- a load buffer of the wrong size: a caller's error, not a bad entry ----------------


@pytest.mark.parametrize("direct_io", ["auto", "off"])
@pytest.mark.parametrize("size", [N // 2, N - 1, N + 1, 2 * N, 1])
def test_a_load_into_a_buffer_of_the_wrong_size_raises_and_keeps_the_entry(
    tmp_path, direct_io, size
):
    # Before: the entry, whole and checked, was removed as "corrupt" (a miss, then a
    # recompute for every engine sharing the directory).
    path = str(tmp_path / "t")
    tier = open_disk(path, direct_io=direct_io)
    try:
        assert store(tier, [1, 2]).all_ok
        outs = [np.zeros(N, np.uint8), np.zeros(size, np.uint8)]
        future = tier.submit_load([(key(2), outs[0]), (key(1), outs[1])])
        with pytest.raises(TierBufferSizeError) as err:
            future.result(timeout=30)
        assert isinstance(err.value, (TierKeyError, KVOffloadValueError))
        msg = str(err.value)
        assert f"items[1] buffer has {size} bytes" in msg and f"payload of {N} bytes" in msg
        assert err.value.result.ok == (True, False)  # the other key loaded as usual
        np.testing.assert_array_equal(outs[0], payload(key(2), N))
        s = tier.stats()
        assert (s.corrupt, s.load_hits, s.load_misses) == (0, 1, 1)
        assert os.path.exists(entry_path(path, 1))
        out = np.zeros(N, np.uint8)
        assert tier.submit_load([(key(1), out)]).result(timeout=30).ok == (True,)
        np.testing.assert_array_equal(out, payload(key(1), N))
    finally:
        tier.close()


def test_a_truncated_entry_is_still_removed(tmp_path):
    # The header decides: a file whose size fits no whole entry stays a bad entry.
    path = str(tmp_path / "t")
    tier = open_disk(path)
    try:
        assert store(tier, [1]).all_ok
        os.truncate(entry_path(path, 1), 4096 + N // 2)
        for size in (N, N // 2):
            r = tier.submit_load([(key(1), np.zeros(size, np.uint8))]).result(timeout=30)
            assert r.ok == (False,)
        assert tier.stats().corrupt == 1 and not os.path.exists(entry_path(path, 1))
        assert tier.stats().entries == 0
    finally:
        tier.close()


def test_the_offloader_reads_a_size_error_as_misses():
    from jax_kvoffload._offloader_tiers import _job_result
    from jax_kvoffload.tiers import TierJobResult

    result = TierJobResult("load", (b"a" * 8, b"b" * 8), (True, False))
    err = TierBufferSizeError("items[1] ...")
    err.result = result
    future = cf.Future()
    future.set_exception(err)
    assert _job_result(future) is result


def test_size_errors_read_by_the_offloader_cost_no_memory_and_one_warning(caplog):
    # Before: every size error appended to a module-level list (to log only the first
    # at WARNING): memory grew with every such load for the life of the process.
    import logging
    import tracemalloc

    from jax_kvoffload import _offloader_tiers
    from jax_kvoffload.tiers import TierJobResult

    def failed() -> cf.Future:
        err = TierBufferSizeError("items[0] buffer has 1 bytes ...")
        err.result = TierJobResult("load", (b"a" * 8,), (False,))
        future = cf.Future()
        future.set_exception(err)
        return future

    _offloader_tiers._job_result(failed())  # the first may warn (or a test before did)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(40_000):
            _offloader_tiers._job_result(failed())
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    where = [tracemalloc.Filter(True, _offloader_tiers.__file__)]
    grown = sum(s.size_diff for s in after.filter_traces(where).compare_to(
        before.filter_traces(where), "filename"))  # fmt: skip
    assert grown < 64 * 1024, f"{grown} bytes kept by 40,000 size errors"
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger=_offloader_tiers.__name__)
    for _ in range(5):  # the later ones at DEBUG
        _offloader_tiers._job_result(failed())
    levels = [r.levelno for r in caplog.records if "buffer has" in r.getMessage()]
    assert levels == [logging.DEBUG] * 5


# ---- a failed syncfs may have reported another file's lost write-back -----------------


def test_files_begun_before_a_failed_syncfs_get_their_own_fdatasync(tmp_path, monkeypatch):
    # Linux reports a filesystem's write-back error to one syncfs only: if the failed
    # call's error was a page of a file queued behind its batch, the next syncfs
    # succeeds while that file's bytes are gone. Before: c and d were reported durable
    # on that next syncfs alone.
    ns = tmp_path / "ns"
    (ns / "00").mkdir(parents=True)
    fd = os.open(ns, os.O_RDONLY | os.O_DIRECTORY)
    calls, entered, release = [], threading.Event(), threading.Event()

    def syncfs(fd):
        calls.append(len(calls))
        if len(calls) == 1:
            entered.set()
            release.wait(10)
            raise OSError(errno.EIO, "syncfs: Input/output error")

    monkeypatch.setattr(_disk_sync, "SYNCFS_MIN_FILES", 1)
    synced = []
    real = os.fdatasync

    def fdatasync(fd):
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    syncer = _disk_sync.Syncer(fd, "test-sync", syncfs=syncfs)

    def submit(name):
        begun = time.monotonic()
        (ns / "00" / f".{name}.tmp").write_bytes(name.encode())
        return syncer.submit("00", f".{name}.tmp", name, begun)

    try:
        first = [submit("a")]
        assert entered.wait(10)  # the batch [a] is in its first syncfs
        second = [submit("c"), submit("d")]  # written while that syncfs fails
        release.set()
        assert all(isinstance(f.result(10), OSError) for f in first)
        assert [f.result(10) for f in second] == [None, None]
        assert sorted(synced) == [".c.tmp", ".d.tmp"]
        synced.clear()
        time.sleep(0.01)
        third = [submit("e"), submit("f")]  # begun after the failure: syncfs suffices
        assert [f.result(10) for f in third] == [None, None]
        assert synced == []
    finally:
        syncer.close()
        os.close(fd)
    assert sorted(os.listdir(ns / "00")) == ["c", "d", "e", "f"]  # a failed, removed


@pytest.mark.parametrize("nth", [1, 2, 5, 9])
def test_an_eio_on_the_nth_fsync_fails_exactly_the_stores_it_covers(tmp_path, monkeypatch, nth):
    # Per-file barriers (no syncfs): the file whose fdatasync fails is not reported and
    # leaves no file; a directory whose fsync fails fails the stores renamed into it.
    # From four threads at once; every store reported done is there, byte for byte.
    monkeypatch.setattr(_disk_sync, "SYNCFS", None)
    lock, count, failed_names = threading.Lock(), [0], []
    real_fdatasync, real_fsync = os.fdatasync, os.fsync

    def failing(real):
        def call(fd):
            with lock:
                count[0] += 1
                hit = count[0] == nth
            if hit:
                failed_names.append(os.readlink(f"/proc/self/fd/{fd}"))
                raise OSError(errno.EIO, "Input/output error")
            real(fd)

        return call

    path = str(tmp_path / "t")
    tier = open_disk(path, write_threads=4)
    monkeypatch.setattr(os, "fdatasync", failing(real_fdatasync))
    monkeypatch.setattr(os, "fsync", failing(real_fsync))
    try:
        ids = list(range(40))
        with cf.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: store(tier, [i], 4096), ids))
        monkeypatch.setattr(os, "fdatasync", real_fdatasync)
        monkeypatch.setattr(os, "fsync", real_fsync)
        ok = {i for i, r in zip(ids, results) if r.all_ok}
        assert len(failed_names) == 1
        assert len(ids) - len(ok) >= 1  # the failed barrier failed at least its store
        assert tier.stats().store_failures == len(ids) - len(ok)
        assert tmp_files(path) == []
        for i in ids:
            exists = os.path.exists(entry_path(path, i))
            if i in ok:
                assert exists
                out = np.zeros(4096, np.uint8)
                assert tier.submit_load([(key(i), out)]).result(30).ok == (True,)
                np.testing.assert_array_equal(out, payload(key(i), 4096))
        if failed_names[0].endswith(".tmp"):  # a file's barrier: exactly that store
            assert len(ids) - len(ok) == 1
    finally:
        tier.close()


# ---- temporary files of an earlier process with this pid ------------------------------


def test_temporary_files_of_an_earlier_process_with_this_pid_are_removed(tmp_path, monkeypatch):
    # A restarted container's engine gets the same pid (often 1): its predecessor's
    # temporary files were taken for this process's own and kept forever. Now: kept
    # only if this process wrote them (its token), else removed once unchanged for
    # TMP_GRACE_S; a file a live writer still changes stays.
    monkeypatch.setattr(_disk_index, "TMP_GRACE_S", 0.5)
    path = str(tmp_path / "t")
    open_disk(path).close()
    shard = os.path.dirname(entry_path(path, 1))
    pid = os.getpid()
    names = {
        "earlier": f".x1.kv.{pid}-0badc0de.7.1.tmp",
        "mine": f".x3.kv.{pid}-{process_token()}.7.3.tmp",
        "live": f".x4.kv.{pid}-0badc0de.7.4.tmp",
    }
    for name in names.values():
        with open(os.path.join(shard, name), "wb") as f:
            f.write(b"\0" * 100)
    tier = open_disk(path)
    try:
        assert tier.wait_rescan(10)
        assert sorted(tmp_files(path)) == sorted(names.values())  # nothing at once
        live = os.path.join(shard, names["live"])
        deadline = time.monotonic() + 10
        while os.path.exists(os.path.join(shard, names["earlier"])):
            assert time.monotonic() < deadline, "not removed after the grace period"
            with open(live, "ab") as f:  # a live writer of another process writes on
                f.write(b"\0")
            time.sleep(0.05)
        time.sleep(0.1)
        assert sorted(tmp_files(path)) == sorted([names["mine"], names["live"]])
    finally:
        tier.close()


def test_temporary_files_a_crash_left_in_the_namespace_directory_are_removed(tmp_path, monkeypatch):
    # The start-up probe for direct I/O and namespace.json are written there under
    # temporary names too; a SIGKILL between their creation and their removal or
    # rename left them forever (the scan looked only inside the shards).
    monkeypatch.setattr(_disk_index, "TMP_GRACE_S", 0.3)
    path = str(tmp_path / "t")
    open_disk(path).close()
    ns_dir = os.path.join(path, NS[:8].hex())
    dead, pid = 2**22 + 1, os.getpid()  # above Linux's largest pid: never alive
    names = [
        f".namespace.json.{dead}-0badc0de.7.1.tmp",
        f".direct-probe.{dead}-0badc0de.7.2.tmp",
        f".namespace.json.{pid}-0badc0de.7.3.tmp",  # an earlier process with this pid
    ]
    for name in names:
        with open(os.path.join(ns_dir, name), "wb") as f:
            f.write(b"\0" * 4096)
    keep = ["not-ours.tmp"]
    with open(os.path.join(ns_dir, keep[0]), "wb") as f:
        f.write(b"x")
    tier = open_disk(path)
    try:
        assert tier.wait_rescan(10)
        deadline = time.monotonic() + 10
        while sorted(os.listdir(ns_dir)) != sorted([*keep, *(f"{i:02x}" for i in range(256))]):
            assert time.monotonic() < deadline, sorted(n for n in os.listdir(ns_dir) if "." in n)
            time.sleep(0.05)
    finally:
        tier.close()


def test_close_does_not_wait_for_the_grace_period(tmp_path):
    path = str(tmp_path / "t")
    open_disk(path).close()
    shard = os.path.dirname(entry_path(path, 1))
    with open(os.path.join(shard, f".x.kv.{os.getpid()}-0badc0de.7.1.tmp"), "wb") as f:
        f.write(b"x")
    tier = open_disk(path)
    assert tier.wait_rescan(10)
    start = time.monotonic()
    tier.close()
    assert time.monotonic() - start < 5


# ---- the budget after files vanish under the index ------------------------------------


def test_an_entry_removed_by_another_process_leaves_the_budget(tmp_path):
    # Before: the index kept it (bytes_used too high for good), and evicting it later
    # counted an eviction this tier never made.
    path = str(tmp_path / "t")
    tier = open_disk(path, capacity_bytes=3 * (4096 + N))
    try:
        assert store(tier, [1, 2]).all_ok
        os.unlink(entry_path(path, 1))  # another engine's eviction
        r = tier.submit_load([(key(1), np.zeros(N, np.uint8))]).result(30)
        assert r.ok == (False,)
        s = tier.stats()
        assert (s.entries, s.bytes_used) == (1, 4096 + N)
        os.unlink(entry_path(path, 2))
        assert store(tier, [3, 4, 5]).all_ok  # over budget: 2 goes (already gone)
        s = tier.stats()
        assert (s.evictions, s.bytes_evicted) == (0, 0)
        assert (s.entries, s.bytes_used) == (3, 3 * (4096 + N))
    finally:
        tier.close()


def test_files_that_are_not_entries_do_not_count_in_the_budget(tmp_path):
    # A sparse terabyte named like an entry, dropped in a shard by a careless operator:
    # before, the scan counted it and evicted every real entry at start.
    path = str(tmp_path / "t")
    entry = 4096 + N
    tier = open_disk(path, capacity_bytes=4 * entry)
    assert store(tier, [1, 2]).all_ok
    tier.close()
    shard_dir = os.path.dirname(entry_path(path, 1))
    shard = os.path.basename(shard_dir)
    other = "00" if shard != "00" else "01"
    bogus = [
        os.path.join(shard_dir, "bogus.kv"),
        os.path.join(shard_dir, other + "0" * 38 + ".kv"),  # a name of another shard
        os.path.join(shard_dir, shard + "0" * 39 + ".kv"),  # too long for an entry
    ]
    for name in bogus:
        with open(name, "wb") as f:
            f.truncate(1 << 40)
    tier = open_disk(path, capacity_bytes=4 * entry)
    try:
        assert tier.wait_rescan(10)
        s = tier.stats()
        assert (s.entries, s.bytes_used, s.evictions) == (2, 2 * entry, 0)
        assert all(os.path.exists(entry_path(path, i)) for i in (1, 2))
        assert all(os.path.exists(name) for name in bogus)  # not ours to remove either
    finally:
        tier.close()


def test_hits_on_another_process_s_entries_keep_the_budget(tmp_path):
    # Before: a hit (or an "already there" store) added the other process's entry to
    # the index without evicting, so bytes_used stayed over capacity_bytes until the
    # next store of this tier's own.
    path = str(tmp_path / "t")
    entry = 4096 + N
    a = open_disk(path, capacity_bytes=2 * entry)
    b = open_disk(path)
    try:
        assert a.wait_rescan(10) and store(b, [1, 2, 3, 4]).all_ok
        for i in (1, 2, 3):
            out = np.zeros(N, np.uint8)
            assert a.submit_load([(key(i), out)]).result(30).ok == (True,)
            assert a.stats().bytes_used <= 2 * entry
        assert store(a, [4]).all_ok  # already there: joins the index, the budget holds
        s = a.stats()
        assert (s.entries, s.bytes_used, s.evictions) == (2, 2 * entry, 2)
        assert [os.path.exists(entry_path(path, i)) for i in (1, 2, 3, 4)] == [
            False,
            False,
            True,
            True,
        ]
    finally:
        a.close()
        b.close()


def test_two_tiers_storing_evicting_and_loading_the_same_keys_never_serve_a_wrong_byte(
    tmp_path,
):
    # Two engines on one directory, budgets small enough that each evicts the other's
    # entries while they load them; several threads each. Every hit is the key's bytes;
    # nothing counts as corrupt; the budgets stay non-negative and within the files seen.
    path = str(tmp_path / "t")
    entry = 4096 + N
    tiers = [open_disk(path, capacity_bytes=6 * entry, write_threads=2) for _ in range(2)]
    stop = time.monotonic() + 3.0
    errors: list[str] = []

    def worker(seed):
        rng = random.Random(seed)
        tier = tiers[seed % 2]
        while time.monotonic() < stop:
            ids = rng.sample(range(16), 3)
            if rng.random() < 0.5:
                store(tier, ids)
            else:
                outs = [np.zeros(N, np.uint8) for _ in ids]
                r = tier.submit_load([(key(i), o) for i, o in zip(ids, outs)]).result(30)
                for i, o, ok in zip(ids, outs, r.ok):
                    if ok and not np.array_equal(o, payload(key(i), N)):
                        errors.append(f"wrong bytes for key {i}")

    try:
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        for tier in tiers:
            s = tier.stats()
            assert s.corrupt == 0 and s.errors == 0
            assert 0 <= s.bytes_used <= 6 * entry and s.bytes_used == s.entries * entry
            assert s.load_hits > 0
        assert tmp_files(path) == []
    finally:
        for tier in tiers:
            tier.close()


def test_close_while_threads_store_and_the_syncer_is_mid_batch(tmp_path, monkeypatch):
    # close() from another thread while four threads store and the syncer sits in a
    # syncfs: every future completes exactly once, each reported store is on disk,
    # close() returns once the batch ends, no temporary file is left.
    entered, release = threading.Event(), threading.Event()

    def syncfs(fd):
        entered.set()
        release.wait(10)

    monkeypatch.setattr(_disk_sync, "SYNCFS", syncfs)
    monkeypatch.setattr(_disk_sync, "SYNCFS_MIN_FILES", 1)
    path = str(tmp_path / "t")
    tier = open_disk(path, write_threads=2)
    futures, lock = [], threading.Lock()

    def storer(base):
        for i in range(base, base + 10):
            try:
                f = tier.submit_store([(key(i), payload(key(i), 4096))])
            except Exception:  # TierClosedError once close() began
                return
            with lock:
                futures.append((i, f))

    threads = [threading.Thread(target=storer, args=(100 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    assert entered.wait(10)
    closer = threading.Thread(target=tier.close)
    closer.start()
    time.sleep(0.1)
    assert closer.is_alive()  # waits for the batch in its syncfs
    release.set()
    closer.join(10)
    for t in threads:
        t.join(10)
    assert not closer.is_alive()
    done = []
    for i, f in futures:
        r = f.result(timeout=1)  # every future completed
        if r.all_ok:
            done.append(i)
            assert os.path.exists(entry_path(path, i))
    assert done and tmp_files(path) == []
