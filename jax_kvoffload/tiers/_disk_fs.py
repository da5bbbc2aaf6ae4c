"""File-system primitives of the disk tier: a private root, names, direct I/O, staging.

Safety rules (DESIGN.md, "Safe to share a machine"): the root directory must be owned by
this user with no group/other access and must not be a symbolic link; every directory
we create is 0700 and every file 0600 (`O_EXCL`, so an existing file is never reused),
the missing parents of the root too, whatever the umask; files are opened with
`O_NOFOLLOW` relative to directory descriptors, and only a regular file we own is ever
opened for reading (`open_regular`): a FIFO, a device, a socket or a directory at an
entry's name is never opened, so it can neither block a thread nor be read.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import logging
import mmap
import os
import stat
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from jax_kvoffload.tiers._entry import check_header
from jax_kvoffload.tiers._errors import TierStateError, UnsafeDirectoryError

logger = logging.getLogger("jax_kvoffload.tiers._disk")  # the tier's own logger, as before

__all__ = [
    "ALIGN",
    "ENTRY_SUFFIX",
    "SHARDS",
    "StagingBuffer",
    "describe_file",
    "entry_name",
    "exact_mode",
    "is_aligned",
    "make_shards",
    "open_private_dir",
    "open_private_root",
    "open_regular",
    "probe_direct_io",
    "process_token",
    "read_all",
    "removed_dir",
    "shard_name",
    "stored_length",
    "tmp_name",
    "write_all",
    "write_description",
]

# Direct I/O needs buffer addresses, offsets and lengths aligned to the logical block
# size (512 B or 4 KiB on Linux filesystems); 4 KiB satisfies both.
ALIGN = 4096
ENTRY_SUFFIX = ".kv"
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# One level of shard directories, all made when a namespace is first opened. 256: a
# million entries are ~4,000 files per directory (ext4 and XFS index directories, so a
# lookup stays a hash probe well past that), and making them costs ~35 ms once. Making
# a directory per entry instead (the two-level layout before) cost more than writing
# the entry; 1,024 or 4,096 directories took 0.5-1.5 s to make on an ext4 virtio disk.
SHARDS = 256


# Names this process's temporary files, with the pid: after a crash the next start can
# tell a dead writer's files from a live one's, also when the new process got the same
# pid (a restarted container's engine is often pid 1, every time). New after a fork.
_token = os.urandom(4).hex()
_tmp_seq = itertools.count()


def _new_token() -> None:
    global _token
    _token = os.urandom(4).hex()


os.register_at_fork(after_in_child=_new_token)


def process_token() -> str:
    """This process's token in its temporary file names (8 hex digits)."""
    return _token


def tmp_name(name: str) -> str:
    """A temporary name for writing `name`: `.<name>.<pid>-<token>.<thread>.<n>.tmp`."""
    return f".{name}.{os.getpid()}-{_token}.{threading.get_native_id()}.{next(_tmp_seq)}.tmp"


def shard_name(index: int) -> str:
    """The directory name of shard `index` (0 <= index < SHARDS): two hex digits."""
    return f"{index:02x}"


def entry_name(namespace: bytes, key: bytes) -> tuple[str, str]:
    """(shard directory, file name) of an entry: content-addressed by namespace + key.

    BLAKE2b, keyed by the namespace, spreads entries evenly over the `SHARDS`
    directories whatever the key distribution.
    """
    h = hashlib.blake2b(key, digest_size=20, key=namespace[:32]).hexdigest()
    return h[:2], h + ENTRY_SUFFIX


def _check_private(fd: int, path: str) -> None:
    st = os.fstat(fd)
    euid = os.geteuid()
    if st.st_uid != euid:
        raise UnsafeDirectoryError(
            f"tier directory {path!r} is owned by uid {st.st_uid}, not by this user "
            f"(uid {euid}); KV bytes are users' prompts: use a directory of your own"
        )
    if st.st_mode & 0o077:
        raise UnsafeDirectoryError(
            f"tier directory {path!r} has mode {stat.S_IMODE(st.st_mode):04o}: group or "
            f"other users can reach users' prompts; run: chmod 700 {path!r}"
        )


def _cannot(path: str, e: OSError) -> TierStateError:
    return TierStateError(
        f"cannot create or open the tier directory {path!r}: {e.strerror or e} "
        f"({e.filename or path}); point path at a writable directory of your own"
    )


def exact_mode(fd: int, mode: int) -> None:
    """Gives the file or directory of `fd` exactly `mode`: a umask can only take bits
    away, and one without owner bits (`umask 0277`) would leave the tier's own shards
    and entries unwritable or unreadable to it (root alone does not notice)."""
    if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
        os.fchmod(fd, mode)


def _mkdir_private(path: str) -> bool:
    """Makes directory `path` with mode exactly 0700 (the umask can only take bits away:
    owner bits it took are given back); False if something exists there already."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return False
    fd = os.open(path, _DIR_FLAGS)
    try:
        exact_mode(fd, 0o700)
    finally:
        os.close(fd)
    return True


def _make_parents(parent: str) -> None:
    """Makes the missing directories of `parent`, each 0700: `os.makedirs` would give
    them the process umask's mode (world-writable under `umask 000`), and another user
    could then swap the tier's directory for one of theirs."""
    missing = []
    while not os.path.isdir(parent):
        missing.append(parent)
        up = os.path.dirname(parent)
        if up == parent:
            break
        parent = up
    for path in reversed(missing):
        _mkdir_private(path)


def open_private_root(path: str) -> int:
    """A directory descriptor of `path`, created 0700 if missing (its missing parents
    too), checked private."""
    try:
        _make_parents(os.path.dirname(os.path.abspath(path)))
        _mkdir_private(path)
    except OSError as e:
        raise _cannot(path, e) from None
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            if os.path.islink(path):
                real = os.path.realpath(path)
                why = f"a symbolic link; links are never followed: configure {real!r} instead"
            else:  # a file, a FIFO, a device where the directory should be
                why = "not a directory: point path at a directory, or move that file away"
            raise UnsafeDirectoryError(f"tier directory {path!r} is {why}") from None
        raise _cannot(path, e) from None
    try:
        _check_private(fd, path)
    except BaseException:  # on any exit: the descriptor is closed
        os.close(fd)
        raise
    return fd


def open_private_dir(parent_fd: int, name: str, where: str) -> tuple[int, bool]:
    """(descriptor, created) of subdirectory `name`, made 0700 if missing, checked ours."""
    created = False
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
        created = True
    except FileExistsError:
        pass
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeDirectoryError(
                f"{where}/{name} is not a directory we made (a link or a file); remove it"
            ) from None
        raise
    try:
        if created:
            exact_mode(fd, 0o700)
        _check_private(fd, f"{where}/{name}")
    except BaseException:  # on any exit: the descriptor is closed
        os.close(fd)
        raise
    return fd, created


def make_shards(ns_fd: int, where: str) -> bool:
    """Makes the missing shard directories of a namespace (0700) and checks every one is
    a directory of ours that nobody else can reach, without following a link.

    Returns whether any was made (the caller then fsyncs the namespace directory once).
    Entries are later opened by `<shard>/<name>` relative to the namespace descriptor:
    the shards are checked here, and only this user can change them afterwards (the
    namespace directory is a 0700 directory of ours).
    """
    made = False
    euid = os.geteuid()
    for i in range(SHARDS):
        name = shard_name(i)
        try:
            st = os.stat(name, dir_fd=ns_fd, follow_symlinks=False)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):  # another process made it meanwhile
                os.mkdir(name, 0o700, dir_fd=ns_fd)
                made = True
                shard_fd = os.open(name, _DIR_FLAGS, dir_fd=ns_fd)
                try:
                    exact_mode(shard_fd, 0o700)
                finally:
                    os.close(shard_fd)
            st = os.stat(name, dir_fd=ns_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafeDirectoryError(
                f"{where}/{name} is not a directory we made (a link or a file); remove it"
            )
        if st.st_uid != euid or st.st_mode & 0o077:
            raise UnsafeDirectoryError(
                f"shard directory {where}/{name} is owned by uid {st.st_uid} with mode "
                f"{stat.S_IMODE(st.st_mode):04o}; it must be this user's (uid {euid}) with "
                f"mode 0700: remove it, or run: chmod 700 {where}/{name!s}"
            )
    return made


def probe_direct_io(dir_fd: int) -> bool:
    """Whether the filesystem of `dir_fd` accepts an O_DIRECT write and read of 4 KiB."""
    if not _O_DIRECT:
        return False
    name = tmp_name("direct-probe")  # a crash leaves it to the next start's scan
    buf = StagingBuffer(ALIGN)
    view = buf.view(ALIGN)
    view[:] = os.urandom(ALIGN)
    fd = -1
    try:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | _O_DIRECT
        fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
        expected = bytes(view)
        if os.pwrite(fd, view, 0) != ALIGN:
            return False
        view[:] = bytes(ALIGN)
        return os.preadv(fd, [view], 0) == ALIGN and bytes(view) == expected
    except OSError:
        return False
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        buf.close()


def is_aligned(view: memoryview) -> bool:
    """Whether a contiguous byte view may be used directly for O_DIRECT I/O."""
    if len(view) % ALIGN:
        return False
    return np.frombuffer(view, dtype=np.uint8).ctypes.data % ALIGN == 0


class StagingBuffer:
    """Page-aligned scratch memory (anonymous mmap) that grows on demand; one per thread."""

    def __init__(self, size: int = 0) -> None:
        self._map: mmap.mmap | None = None
        self._size = 0
        if size:
            self._grow(size)

    def _grow(self, size: int) -> None:
        size = -(-size // ALIGN) * ALIGN
        self.close()
        self._map = mmap.mmap(-1, size)
        self._size = size

    def view(self, size: int) -> memoryview:
        """A writable view of the first `size` bytes (contents unspecified)."""
        if size > self._size:
            self._grow(max(size, 2 * self._size))
        assert self._map is not None
        return memoryview(self._map)[:size]

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still exported: GC frees it
                self._map.close()
            self._map = None


def write_all(fd: int, bufs: Sequence[bytes | memoryview], total: int) -> None:
    # Regular files are written whole or fail; a short count means the disk filled up
    # mid-write, and the next write would say so.
    done = os.pwritev(fd, bufs, 0)
    if done < total:
        raise OSError(errno.ENOSPC, f"short write: {done} of {total} bytes")


_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def describe_file(st: os.stat_result) -> str | None:
    """None for a regular file of this user; else what it is ("a FIFO", ...)."""
    for test, kind in _KINDS:
        if test(st.st_mode):
            return kind
    if not stat.S_ISREG(st.st_mode):
        return f"a file of type {stat.S_IFMT(st.st_mode):o}"
    if st.st_uid != os.geteuid():
        return f"a file of uid {st.st_uid}, not ours"
    return None


def open_regular(name: str, dir_fd: int, flags: int = 0) -> tuple[int, os.stat_result]:
    """(descriptor, fstat) of `name` (relative to `dir_fd`) opened read-only, or (-1,
    its lstat) when it is not a regular file of ours (`describe_file` says what).

    Only a regular file is ever opened: a FIFO would block `open` until a writer came
    (and the tier's `close()` with it), a device runs its driver's open, a socket or a
    directory is no entry. `lstat` first, so none of those is opened; `O_NONBLOCK` and
    `O_NOFOLLOW` in case the name changed meanwhile (`O_NONBLOCK` changes nothing for a
    regular file), and the descriptor's own `fstat` decides. OSError (absent, EACCES)
    propagates.
    """
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if describe_file(st) is not None:
        return -1, st
    flags |= os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENXIO, errno.ENODEV, errno.EISDIR):
            raise
        # Replaced since the lstat by a link, a socket, a device, a directory.
        return -1, os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    try:
        now = os.fstat(fd)
    except BaseException:  # on any exit: the descriptor is closed
        os.close(fd)
        raise
    if describe_file(now) is not None:
        os.close(fd)
        return -1, now
    return fd, now


def read_all(fd: int, bufs: list[memoryview], total: int) -> int:
    # A regular file reads whole up to its end; fewer bytes mean the file is shorter.
    return os.preadv(fd, bufs, 0)


def removed_dir(dir_fd: int) -> bool:
    """Whether the directory open at `dir_fd` was removed (no name links to it now)."""
    try:
        return os.fstat(dir_fd).st_nlink == 0
    except OSError:
        return False


def stored_length(
    fd: int, stage: StagingBuffer, namespace: bytes, key: bytes, size: int
) -> int | None:
    """The payload length of the entry open at `fd` (`size` bytes) if its header is
    whole, names this key and namespace, and agrees with the file's size; else None."""
    head = stage.view(ALIGN)
    if size < ALIGN or read_all(fd, [head], ALIGN) < ALIGN:
        return None
    hdr = check_header(head, namespace=namespace, key=key)
    if isinstance(hdr, str):
        return None
    plen = hdr.payload_len
    fits = ALIGN + plen <= size <= -(-(ALIGN + plen) // ALIGN) * ALIGN
    return plen if fits and hdr.header_len == ALIGN else None


def write_description(ns_fd: int, describe: Mapping[str, object]) -> None:
    """Writes `describe` as JSON to `namespace.json` in the namespace directory
    (atomically: a temporary file renamed into place); a failure is logged only."""
    data = json.dumps(dict(describe), indent=2, sort_keys=True).encode()
    tmp = tmp_name("namespace.json")
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=ns_fd)
        try:
            exact_mode(fd, 0o600)
            os.write(fd, data)
        finally:
            os.close(fd)
        os.rename(tmp, "namespace.json", src_dir_fd=ns_fd, dst_dir_fd=ns_fd)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=ns_fd)
        logger.warning("disk tier: could not write namespace.json: %s", e)
