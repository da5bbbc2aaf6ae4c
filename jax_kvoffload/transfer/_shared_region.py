"""Host memory shared by the worker processes of one engine (canonical pages).

With canonical pages, every rank of a TP x PCP group writes its own bytes into the same
host rows and reads its page back from them, so the rows must be one memory for all
worker processes. `SharedHostRegion` maps one file of the POSIX shared-memory mount
(`/dev/shm`, else the temp directory) into every process:

* The first process builds the file under a private name (size, header) and publishes it
  with an atomic `link`; the others open the published file, so nobody sees it half made.
* The header counts attachments under an exclusive `flock`. The process that completes the
  count (`expected_attachments`) unlinks the name: the memory lives while any process maps
  it and is reclaimed by the kernel when the last one unmaps or exits.
* A name left by a crashed run (its creator dead, count never completed) is replaced.
* Every process must ask for the same size; a mismatch is an error naming both sizes.
* Opening, replacing a stale file and counting happen under the file's `flock`, and a
  name is removed only while it still points at the file checked (no process removes a
  newer run's file). The memory is reserved when the file is made (`posix_fallocate`), so
  a shared-memory mount too small fails with an error instead of a SIGBUS later.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import pathlib
import struct
import tempfile

import numpy as np

logger = logging.getLogger(__name__)

_MAGIC = b"JAXKVSHM"
_HEADER = struct.Struct("<8sQqQQ")  # magic, data bytes, creator pid, expected, attached
HEADER_BYTES = mmap.PAGESIZE


class SharedRegionError(RuntimeError):
    """The shared host region cannot be created or joined (the message says why)."""


def shm_dir() -> pathlib.Path:
    d = pathlib.Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else pathlib.Path(tempfile.gettempdir())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedHostRegion:
    """`nbytes` of host memory shared by `expected_attachments` processes under `name`.

    Args:
      name: file name in the shared-memory directory (one per engine: include its id).
      nbytes: data bytes (every attaching process must agree).
      expected_attachments: how many processes will attach; the last one unlinks the name.
      directory: where the name lives (default `/dev/shm`, else the temp directory).

    `array` is the data as a writable uint8 numpy array. `close()` unmaps it (views must
    be dropped first); the memory is freed when every process has closed or exited.
    """

    def __init__(
        self,
        name: str,
        nbytes: int,
        expected_attachments: int,
        *,
        directory: str | os.PathLike | None = None,
    ) -> None:
        if "/" in name or not name:
            raise SharedRegionError(f"bad region name {name!r}: one file name, no '/'")
        if nbytes < 0 or expected_attachments < 1:
            raise SharedRegionError(
                f"nbytes must be >= 0 and expected_attachments >= 1; got {nbytes}, "
                f"{expected_attachments}"
            )
        self.path = pathlib.Path(directory or shm_dir()) / name
        self.nbytes = nbytes
        self.created = False
        fd = self._open_or_create(nbytes, expected_attachments)
        try:
            self._inode = os.fstat(fd).st_ino
            self._mmap = mmap.mmap(fd, HEADER_BYTES + nbytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8, offset=HEADER_BYTES, count=nbytes)

    def _open_or_create(self, nbytes: int, expected: int) -> int:
        """An fd of the region this process has attached to (counted in its header)."""
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                fd = self._create(nbytes, expected)
                if fd is None:
                    continue  # another process published first: join theirs
            try:
                if self._attach(fd, nbytes, expected):
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # stale or full: replaced, try again
        raise SharedRegionError(f"could not create or join {self.path} (raced 5 times)")

    def _ours(self, fd: int) -> bool:
        """The name still points at the file behind `fd` (not a newer run's file)."""
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _attach(self, fd: int, nbytes: int, expected: int) -> bool:
        """Under the file's lock: checks the header, then counts this process in, and the
        process completing the count removes the name. Returns False (after removing the
        name if it is still this file's) when the file is a crashed run's or is full."""
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            magic, size, creator, want, attached = _HEADER.unpack(os.pread(fd, _HEADER.size, 0))
            if magic != _MAGIC:
                raise SharedRegionError(f"{self.path} exists but is not a jax_kvoffload region")
            if not _pid_alive(creator) or attached >= want:
                if self._ours(fd):
                    logger.warning("replacing stale shared region %s", self.path)
                    os.unlink(self.path)
                return False
            if (size, want) != (nbytes, expected):
                raise SharedRegionError(
                    f"{self.path} holds {size} bytes for {want} processes but this process "
                    f"asks for {nbytes} bytes for {expected}; every worker must size the "
                    "region alike (same config, same KV cache layout)"
                )
            attached += 1
            os.pwrite(fd, _HEADER.pack(magic, size, creator, want, attached), 0)
            self.attached_as = attached
            if attached == want and self._ours(fd):
                os.unlink(self.path)
            return True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _create(self, nbytes: int, expected: int) -> int | None:
        """Builds the file under a private name and publishes it; None if another process
        published first."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # left by a crashed process that had our pid
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            self._reserve(fd, HEADER_BYTES + nbytes)
            os.pwrite(fd, _HEADER.pack(_MAGIC, nbytes, os.getpid(), expected, 0), 0)
            try:
                os.link(tmp, self.path)  # atomic publish
            except FileExistsError:
                os.close(fd)
                return None
            self.created = True
            return fd
        except BaseException:
            if not self.created:
                os.close(fd)
            raise
        finally:
            os.unlink(tmp)

    def _reserve(self, fd: int, size: int) -> None:
        """Sizes the file and claims its memory now: a tmpfs too small for it would
        otherwise kill the process with SIGBUS at the first store past its end."""
        os.ftruncate(fd, size)
        if not hasattr(os, "posix_fallocate"):
            return
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return  # the filesystem cannot preallocate: sized by ftruncate only
            raise SharedRegionError(
                f"cannot reserve {size} bytes in {self.path.parent} ({e.strerror}); give the "
                "shared-memory mount more room (docker: --shm-size or --ipc=host) or lower "
                "cpu_bytes_to_use"
            ) from e

    def attachments(self) -> tuple[int, int]:
        """`(attached, expected)`: how many processes have joined so far, of how many."""
        if self._mmap is None:
            raise SharedRegionError(f"{self.path} is closed")
        _, _, _, want, attached = _HEADER.unpack_from(self._mmap, 0)
        return attached, want

    def close(self) -> None:
        """Unmaps this process's view (idempotent) and, if this process made the region
        and not every expected process attached, removes its name. With numpy views of
        `array` still alive the memory stays mapped until they are gone."""
        if self._mmap is None:
            return
        if self.created:  # a run that never completed its attachments: remove our name
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_ino == self._inode:  # not a newer run's file
                    os.unlink(self.path)
        self.array = None
        try:
            self._mmap.close()
        except BufferError:
            logger.debug("shared region %s still has views; unmapped when they go", self.path)
        self._mmap = None

    def __enter__(self) -> SharedHostRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
