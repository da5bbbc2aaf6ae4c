"""The memory of a `SharedHostRegion`: a sealed, private memfd, and the checks a received
one must pass before this process maps it.

A memfd has no name in any filesystem: it exists while a process holds its descriptor or
maps it, and the kernel frees it when the last one is gone, however they exit (SIGKILL
included). Nothing can be left behind in `/dev/shm`, and no other user can reach it by a
path. Its pages come from the kernel's internal tmpfs, charged to the memory cgroup of
the process that reserves them, not to the `/dev/shm` mount (so Docker's `--shm-size`
does not bound it; the container's memory limit does).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import pathlib
import stat
import struct
import sys

from jax_kvoffload.hostmem._shm_errors import SharedRegionError

logger = logging.getLogger(__name__)

MAGIC = b"JAXKVMFD"
VERSION = 1
# magic, version, creator pid, data bytes, expected attachments, creation nonce
HEADER = struct.Struct("<8sIiQQ16s")
SLOTS_OFFSET = 64  # one byte per attachment slot: 1 once a process has mapped the region
HEADER_BYTES = mmap.PAGESIZE
MAX_ATTACHMENTS = 256
MEMFD_PREFIX = "jax_kvoffload:"
# Nobody (ourselves included) may shrink or grow the memory once it is made: a shrink
# would make every other process's next access past the new end a SIGBUS.
_SEALS = (
    getattr(fcntl, "F_SEAL_SEAL", 1)
    | getattr(fcntl, "F_SEAL_SHRINK", 2)
    | getattr(fcntl, "F_SEAL_GROW", 4)
)


def unsupported() -> str | None:
    """Why this platform cannot hold a shared region, or None."""
    if not sys.platform.startswith("linux"):
        return (
            "shared host regions need Linux (memfd and abstract Unix sockets); this is "
            f"{sys.platform}"
        )
    if not hasattr(os, "memfd_create") or not hasattr(fcntl, "F_ADD_SEALS"):
        return (
            "this Python lacks os.memfd_create or fcntl.F_ADD_SEALS (need Python >= 3.9 on Linux)"
        )
    return None


def create(nbytes: int, expected: int, memfd_name: str, label: str) -> int:
    """A new sealed memfd of `HEADER_BYTES + nbytes`, all of it reserved, mode 0600, its
    header written. The caller owns the returned descriptor."""
    fd = os.memfd_create(memfd_name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)  # memfds start 0777; nobody else may open /proc/<pid>/fd/N
        size = HEADER_BYTES + nbytes
        check_memory(size, label)
        os.ftruncate(fd, size)
        _reserve(fd, size, label)
        header = HEADER.pack(MAGIC, VERSION, os.getpid(), nbytes, expected, os.urandom(16))
        os.pwrite(fd, header, 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        return fd
    except BaseException:  # on any exit: the descriptor is closed
        os.close(fd)
        raise


def verify(fd: int, nbytes: int, expected: int, label: str) -> None:
    """Raises unless `fd` is a region made by this library for this user, sealed, of the
    size and attachment count this process asks for."""
    st = os.fstat(fd)
    euid = os.geteuid()
    if not stat.S_ISREG(st.st_mode) or st.st_uid != euid or st.st_mode & 0o077:
        raise SharedRegionError(
            f"{label}: the memory handed over is not a private region of this user (owner "
            f"uid {st.st_uid}, mode {stat.filemode(st.st_mode)}; want uid {euid}, 0600); "
            "refusing to map it"
        )
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        target = None  # no /proc: the owner, mode, seals and header checks still apply
    if target is not None and not target.startswith("/memfd:" + MEMFD_PREFIX):
        raise SharedRegionError(f"{label}: the memory handed over is {target!r}, not a memfd")
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & _SEALS != _SEALS:
        raise SharedRegionError(f"{label}: the memory handed over is not sealed against resizing")
    magic, version, _, size, want, _ = HEADER.unpack(os.pread(fd, HEADER.size, 0))
    if (magic, version) != (MAGIC, VERSION):
        raise SharedRegionError(f"{label}: the memory handed over is not a jax_kvoffload region")
    if (size, want) != (nbytes, expected):
        raise SharedRegionError(
            f"{label} holds {size} bytes for {want} processes but this process asks for "
            f"{nbytes} bytes for {expected}; every worker must size the region alike (same "
            "config, same KV cache layout)"
        )
    if st.st_size != HEADER_BYTES + size:
        raise SharedRegionError(
            f"{label}: its memory is {st.st_size} bytes, not {HEADER_BYTES + size}"
        )


def _reserve(fd: int, size: int, label: str) -> None:
    """Claims every page now, so that a machine too small fails here with an error
    instead of the first store past the limit killing a process later."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return  # cannot preallocate: pages come on first touch
        raise SharedRegionError(
            f"cannot reserve {size} bytes of shared memory for {label} ({e.strerror}): "
            "lower cpu_bytes_to_use or give the host or container more memory (docker "
            "--memory; the region is a memfd, charged to the memory limit, so --shm-size "
            "and the size of /dev/shm do not bound it)"
        ) from e


def check_memory(size: int, label: str) -> None:
    """Refuses a size no memory here could hold, before reserving page by page."""
    for what, limit in _memory_limits():
        if size > limit:
            raise SharedRegionError(
                f"cannot reserve {size} bytes of shared memory for {label}: {what} is "
                f"{limit} bytes; lower cpu_bytes_to_use or give the host or container more "
                "memory (docker --memory; --shm-size does not bound a memfd region)"
            )


def _memory_limits() -> list[tuple[str, int]]:
    out = []
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "MemAvailable":
                out.append(("MemAvailable (/proc/meminfo)", int(value.split()[0]) * 1024))
    except (OSError, ValueError, IndexError):
        pass
    try:
        for line in pathlib.Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                path = pathlib.Path("/sys/fs/cgroup") / line[3:].lstrip("/") / "memory.max"
                value = path.read_text().strip()
                if value != "max":
                    out.append((f"the cgroup memory limit ({path})", int(value)))
    except (OSError, ValueError):
        pass
    return out
