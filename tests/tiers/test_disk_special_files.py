"""The disk tier against files that are not entries: a FIFO, a character device, a
socket, a directory or a link where an entry, a temporary file, a namespace or the
tier's directory should be, and a process umask of 000.

Before: a FIFO at an entry's name blocked the reader thread in `open(2)` for good, and
`close()` with it; the directories the tier made above its own took the umask's mode
(0777 under `umask 000`). Now only a regular file of ours is ever opened for reading
(nothing else is read, nothing blocks) and every directory the tier makes is 0700.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import stat
import threading
import time

import numpy as np
import pytest

from jax_kvoffload.tiers import DiskTier, DiskTierConfig, UnsafeDirectoryError, _disk_sync
from jax_kvoffload.tiers._disk_fs import entry_name

from ._helpers import key, payload

NS = bytes(range(32))
N = 8192
WAIT_S = 10  # far longer than any of these jobs takes; a blocked thread never ends


def open_disk(path, describe=None, **kw):
    kw.setdefault("capacity_bytes", 1 << 30)
    return DiskTier(DiskTierConfig(path=path, **kw), NS, describe=describe)


def entry_path(path, i):
    shard, name = entry_name(NS, key(i))
    return os.path.join(path, NS[:8].hex(), shard, name)


def make_fifo(p):
    os.mkfifo(p, 0o600)


def make_chardev(p):
    if os.geteuid() != 0:
        pytest.skip("mknod of a device needs root")
    os.mknod(p, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero: reads never end


def make_socket(p):
    # Bound by its base name from its directory: pytest's paths pass AF_UNIX's 108 bytes.
    cwd = os.getcwd()
    with socket.socket(socket.AF_UNIX) as s:
        os.chdir(os.path.dirname(p))
        try:
            s.bind(os.path.basename(p))
        finally:
            os.chdir(cwd)
    # The socket file stays.


def make_dir(p):
    os.mkdir(p, 0o700)


def make_link_to_fifo(p):
    make_fifo(p + ".target")
    os.symlink(p + ".target", p)


KINDS = {
    "fifo": make_fifo,
    "chardev": make_chardev,
    "socket": make_socket,
    "directory": make_dir,
    "link-to-fifo": make_link_to_fifo,
}


def unblock(p):
    """Opens the FIFO at `p` for writing if a reader waits in open(2): the old code's
    reader thread then returns instead of holding the test (and close()) for good."""
    for _ in range(3):
        with contextlib.suppress(OSError):
            os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
        time.sleep(0.01)


def close_within(tier, seconds=WAIT_S):
    t = threading.Thread(target=tier.close, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


class OpenSpy:
    """Records every os.open for reading of a name that is neither a regular file nor
    a directory opened as one (O_DIRECTORY), nor a file being created (O_CREAT)."""

    def __init__(self, monkeypatch):
        self.bad = []
        real = os.open

        def spy(path, flags, mode=0o777, *, dir_fd=None):
            reading = flags & os.O_ACCMODE == os.O_RDONLY
            if reading and not flags & (os.O_DIRECTORY | os.O_CREAT):
                try:
                    st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
                except OSError:
                    st = None
                if st is not None and not stat.S_ISREG(st.st_mode):
                    self.bad.append((path, stat.filemode(st.st_mode)))
            return real(path, flags, mode, dir_fd=dir_fd)

        monkeypatch.setattr(os, "open", spy)


@pytest.mark.parametrize("direct_io", ["auto", "off"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_load_never_opens_what_is_not_a_regular_file(tmp_path, monkeypatch, kind, direct_io):
    path = str(tmp_path / "t")
    tier = open_disk(path, direct_io=direct_io)
    target = entry_path(path, 1)
    KINDS[kind](target)
    spy = OpenSpy(monkeypatch)
    out = np.zeros(N, np.uint8)
    try:
        result = tier.submit_load([(key(1), out)]).result(timeout=WAIT_S)
    finally:
        unblock(target)
        unblock(target + ".target")
    assert result.ok == (False,)
    assert spy.bad == [], f"opened for reading: {spy.bad}"
    s = tier.stats()
    assert (s.load_misses, s.corrupt, s.errors) == (1, 1, 0)  # a bad entry, not an I/O error
    assert not os.path.lexists(target)  # removed (an empty directory too)
    assert tier.contains([key(1)]) == [False]
    # The key can be stored again and then served.
    data = payload(key(1), N)
    assert tier.submit_store([(key(1), data)]).result(timeout=WAIT_S).all_ok
    assert tier.submit_load([(key(1), out)]).result(timeout=WAIT_S).ok == (True,)
    np.testing.assert_array_equal(out, data)
    assert close_within(tier)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_store_over_what_is_not_a_regular_file_replaces_it(tmp_path, kind):
    path = str(tmp_path / "t")
    tier = open_disk(path)
    try:
        KINDS[kind](entry_path(path, 1))
        assert tier.contains([key(1)]) == [False]
        r = tier.submit_store([(key(1), payload(key(1), N))]).result(timeout=WAIT_S)
        assert r.all_ok and tier.stats().keys_already_present == 0
        assert stat.S_ISREG(os.lstat(entry_path(path, 1)).st_mode)
    finally:
        unblock(entry_path(path, 1) + ".target")
        assert close_within(tier)


def test_a_directory_holding_files_at_an_entry_name_is_a_miss_and_is_kept(tmp_path):
    path = str(tmp_path / "t")
    with open_disk(path) as tier:
        os.mkdir(entry_path(path, 1))
        with open(os.path.join(entry_path(path, 1), "theirs"), "wb") as f:
            f.write(b"an operator's file")
        r = tier.submit_load([(key(1), np.zeros(N, np.uint8))]).result(timeout=WAIT_S)
        assert r.ok == (False,) and tier.stats().corrupt == 1
        assert os.path.isfile(os.path.join(entry_path(path, 1), "theirs"))
        r = tier.submit_store([(key(1), payload(key(1), N))]).result(timeout=WAIT_S)
        assert r.ok == (False,)  # the rename cannot replace it: a failed store, no hang


def test_a_temporary_file_swapped_for_a_fifo_fails_its_store_without_blocking(
    tmp_path, monkeypatch
):
    # fsync=True: the syncer opens each written temporary file again for its fdatasync.
    path = str(tmp_path / "t")
    tier = open_disk(path, fsync=True)
    fifos = []
    real_submit = _disk_sync.Syncer.submit

    def swap(self, shard, tmp, final, begun=None):
        where = os.path.join(path, NS[:8].hex(), shard, tmp)
        os.unlink(where)
        make_fifo(where)
        fifos.append(where)
        return real_submit(self, shard, tmp, final, begun)

    monkeypatch.setattr(_disk_sync.Syncer, "submit", swap)
    try:
        future = tier.submit_store([(key(1), payload(key(1), N))])
        r = future.result(timeout=WAIT_S)
    finally:
        for p in fifos:
            unblock(p)
    assert r.ok == (False,) and tier.stats().store_failures == 1
    assert close_within(tier)
    assert not os.path.lexists(entry_path(path, 1))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_start_up_scan_skips_what_is_not_a_regular_file(tmp_path, kind):
    path = str(tmp_path / "t")
    with open_disk(path) as tier:
        assert tier.submit_store([(key(2), payload(key(2), N))]).result(timeout=WAIT_S).all_ok
    shard_dir = os.path.dirname(entry_path(path, 1))
    places = [
        entry_path(path, 1),  # an entry's name
        os.path.join(shard_dir, f".x.kv.{2**22 + 1}-0badc0de.7.1.tmp"),  # a dead writer's
        os.path.join(path, "0123456789abcdef"),  # a namespace's name
        os.path.join(path, NS[:8].hex(), "namespace.json"),
    ]
    for p in places:
        KINDS[kind](p)
    try:
        tier = open_disk(path)
        assert tier.wait_rescan(WAIT_S)
        s = tier.stats()
        assert (s.entries, s.errors) == (1, 0)  # key 2 alone
        assert tier.submit_load([(key(2), np.zeros(N, np.uint8))]).result(WAIT_S).all_ok
        assert close_within(tier)
    finally:
        for p in places:
            unblock(p)
            unblock(p + ".target")


@pytest.mark.parametrize("kind", ["fifo", "socket", "chardev"])
def test_a_special_file_as_the_tier_or_namespace_directory_is_refused_at_once(tmp_path, kind):
    root = str(tmp_path / "t")
    KINDS[kind](root)
    with pytest.raises(UnsafeDirectoryError, match="not a directory"):
        open_disk(root)
    os.unlink(root)
    open_disk(root).close()
    ns = os.path.join(root, NS[:8].hex())
    shutil.rmtree(ns)
    KINDS[kind](ns)
    with pytest.raises(UnsafeDirectoryError, match="not a directory"):
        open_disk(root)


@pytest.fixture
def umask_000():
    old = os.umask(0)
    yield
    os.umask(old)


@pytest.mark.usefixtures("umask_000")
def test_under_umask_000_every_directory_the_tier_makes_is_private(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    path = base / "a" / "b" / "tier"
    with open_disk(str(path), describe={"model": "m"}) as tier:
        assert tier.submit_store([(key(1), payload(key(1), N))]).result(WAIT_S).all_ok
    made = [base / "a", base / "a" / "b", path, path / NS[:8].hex()]
    made += [p for p in (path / NS[:8].hex()).iterdir() if p.is_dir()]
    assert len(made) == 4 + 256
    modes = {str(p): stat.filemode(p.stat().st_mode) for p in made}
    assert set(modes.values()) == {"drwx------"}, {k: v for k, v in modes.items() if v[4:] != "---"}
    files = [entry_path(str(path), 1), path / NS[:8].hex() / "namespace.json"]
    assert {stat.filemode(os.stat(f).st_mode) for f in files} == {"-rw-------"}
    assert stat.S_IMODE(base.stat().st_mode) != 0o700  # an existing parent is left alone


def test_a_umask_without_owner_bits_still_gives_a_usable_tier(tmp_path):
    old = os.umask(0o277)  # owner write taken away: mkdir(0700) alone makes 0500
    try:
        path = tmp_path / "x" / "tier"
        with open_disk(str(path)) as tier:
            assert tier.submit_store([(key(1), payload(key(1), N))]).result(WAIT_S).all_ok
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "x").stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_open_regular_answers_what_a_name_is(tmp_path):
    from jax_kvoffload.tiers._disk_fs import describe_file, open_regular

    d = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        (tmp_path / "f").write_bytes(b"x")
        fd, st = open_regular("f", d)
        assert fd >= 0 and stat.S_ISREG(st.st_mode)
        os.close(fd)
        for kind, make in KINDS.items():
            if kind == "chardev" and os.geteuid() != 0:
                continue
            make(str(tmp_path / kind))
            fd, st = open_regular(kind, d)
            assert fd == -1 and describe_file(st), kind
        with pytest.raises(OSError) as err:
            open_regular("absent", d)
        assert err.value.errno == errno.ENOENT
    finally:
        os.close(d)
