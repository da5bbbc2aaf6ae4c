"""How the processes of one `SharedHostRegion` find each other and pass its memory.

Every name lives in Linux's abstract Unix-socket namespace: no file is ever made, and the
kernel releases a name the moment the socket bound to it is closed, also when its process
is killed. Names are `sha256(euid, region name, role)`, so one user's regions never meet
another's, and seeing one name (in /proc/net/unix) does not tell the others.

* `lock`: bound by the one process that is joining or creating the region right now;
  it serialises joins, so a process never creates a second memory while another holds
  the first (the split behind issue 12, item 4).
* `slot{i}`: bound by every process that has mapped the region (rank i, or the i-th to
  come); a thread answers each connection from a process of the same user with the
  region's descriptor (SCM_RIGHTS). Any holder can serve, so ranks join in any order,
  and any of them may die first.

Both ends check the peer's credentials (SO_PEERCRED): memory is sent only to, and taken
only from, processes of this user. A process of another user found on a name is a typed
error (`ForeignPeerError`), never a silent fallback; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import socket
import struct
import threading
import time
import weakref
from typing import NamedTuple

from jax_kvoffload.hostmem._shm_errors import ForeignPeerError, SharedRegionTimeoutError

logger = logging.getLogger(__name__)

HELLO = b"JAXKVSHM1"
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_SERVE_TIMEOUT_S = 5.0


class Peer(NamedTuple):
    pid: int
    uid: int


def address(name: str, role: str, uid: int | None = None) -> bytes:
    """The abstract socket name of `role` for region `name` of user `uid` (default: us)."""
    uid = os.geteuid() if uid is None else uid
    digest = hashlib.sha256(f"{uid}\0{name}\0{role}".encode()).hexdigest()[:40]
    return b"\0jax_kvoffload." + digest.encode()


def peer_of(sock: socket.socket) -> Peer:
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return Peer(pid, uid)


def refuse_foreign(peer: Peer, label: str, role: str) -> None:
    if peer.uid != os.geteuid():
        raise ForeignPeerError(
            f"{label}: a process of another user (uid {peer.uid}, pid {peer.pid}) holds its "
            f"{role} name; nothing was exchanged with it. Pick a region name other users "
            "cannot guess (vLLM: leave kv_transfer_config.engine_id unset so it is a random "
            "uuid) or stop that process",
            uid=peer.uid,
            pid=peer.pid,
        )


def bind(addr: bytes) -> socket.socket | None:
    """A listening socket bound to `addr`, or None when a live socket holds the name."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(addr)
        sock.listen(16)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            return None
        raise
    return sock


def probe(addr: bytes) -> Peer | None:
    """Who listens on `addr` (None: nobody, or a socket that does not listen or whose
    queue is full)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        try:
            sock.connect(addr)
        except OSError:
            return None
        return peer_of(sock)


def acquire_lock(addr: bytes, deadline: float, label: str) -> socket.socket:
    """Binds the region's lock name, waiting (at most until `deadline`) while another
    process of this user holds it. Close the returned socket to release it."""
    delay, checked = 0.002, False
    while True:
        sock = bind(addr)
        if sock is not None:
            return sock
        if not checked:  # a squatter of another user would never let go: say so at once
            holder = probe(addr)
            if holder is not None:
                refuse_foreign(holder, label, "lock")
            checked = True
        now = time.monotonic()
        if now >= deadline:
            holder = probe(addr)
            who = f"process {holder.pid}" if holder else "a process that does not answer"
            raise SharedRegionTimeoutError(
                f"{label}: {who} has held its rendezvous lock past the timeout (a worker "
                "stopped or hung while joining, or still reserving a very large region). "
                "Stop that process, or pass a larger timeout",
                pid=holder.pid if holder else None,
            )
        time.sleep(min(delay, deadline - now))
        delay = min(2 * delay, 0.05)


def fetch(addr: bytes, timeout: float, label: str) -> tuple[int | None, Peer | None]:
    """Asks the holder listening on `addr` for the region's descriptor.

    Returns `(fd, peer)` when it handed one over, `(None, None)` when nobody holds the
    name, and `(None, peer)` when a process of this user holds it but did not answer in
    `timeout` seconds (`peer.pid` is -1 when not even its queue took the connection)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(max(timeout, 0.001))
        try:
            sock.connect(addr)
        except (ConnectionRefusedError, FileNotFoundError):
            return None, None
        except (BlockingIOError, TimeoutError):
            return None, Peer(-1, os.geteuid())
        holder = peer_of(sock)
        refuse_foreign(holder, label, "holder")
        try:
            msg, fds, flags, _ = socket.recv_fds(sock, 64, 1, socket.MSG_CMSG_CLOEXEC)
        except OSError:  # timed out, or the holder closed while we asked
            return None, holder
        if msg == HELLO and len(fds) == 1 and not flags & socket.MSG_CTRUNC:
            return fds[0], holder
        for fd in fds:
            os.close(fd)
        return None, holder


_live_servers: weakref.WeakSet[FdServer] = weakref.WeakSet()


class FdServer:
    """Answers every connection to `listener` from a process of this user with `fd`,
    on a daemon thread, until `close()`."""

    def __init__(self, listener: socket.socket, fd: int, label: str) -> None:
        self._listener = listener
        self._fd = fd
        self._label = label
        self._thread = threading.Thread(
            target=self._serve, name="jax_kvoffload-shm-serve", daemon=True
        )
        _live_servers.add(self)
        self._thread.start()

    def _serve(self) -> None:
        euid = os.geteuid()
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(_SERVE_TIMEOUT_S)
                    peer = peer_of(conn)
                    if peer.uid != euid:
                        logger.warning(
                            "%s: refused its memory to a process of another user (uid %d, pid %d)",
                            self._label,
                            peer.uid,
                            peer.pid,
                        )
                        continue
                    socket.send_fds(conn, [HELLO], [self._fd])
                except OSError as e:  # the asker went away: its problem, not ours
                    logger.debug("%s: could not hand the region over: %s", self._label, e)

    def close(self) -> None:
        """Stops serving (the name is free when this returns)."""
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._thread.join(2 * _SERVE_TIMEOUT_S)
        self._listener.close()
        _live_servers.discard(self)

    def _forget_in_child(self) -> None:
        # A forked child has no serving thread: it must not keep the name, or newcomers
        # would wait on it for an answer that never comes.
        self._listener.close()


def _after_fork_in_child() -> None:
    for server in list(_live_servers):
        server._forget_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
