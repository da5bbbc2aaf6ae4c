"""Forked child processes for the shared-region tests: cheap (no re-import of JAX), as
another uid when asked (a second local user), killable at any point.

A child runs `fn(conn, *args)` and talks to the parent over `conn` (a Pipe end). A child
that raises sends its traceback, which the parent's `recv` raises as an AssertionError.
Modules a child may need are imported here, before it drops to another uid (that user
cannot read the interpreter's own directories when they live under /root).
"""

from __future__ import annotations

import contextlib
import fcntl  # noqa: F401  (imported for children running as another user)
import hashlib  # noqa: F401
import mmap  # noqa: F401
import multiprocessing as mp
import os
import signal
import socket  # noqa: F401
import struct  # noqa: F401
import time
import traceback
import warnings

import pytest

NOBODY = 65534


def needs_root():
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root, to run a child as a second local user")


class ChildFailed:
    def __init__(self, text: str) -> None:
        self.text = text


def _main(fn, conn, uid, args):
    try:
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        fn(conn, *args)
    except BaseException:
        conn.send(ChildFailed(traceback.format_exc()))
        raise


class Forked:
    """One forked child running `fn(conn, *args)`, as `uid` when given."""

    def __init__(self, fn, *args, uid: int | None = None) -> None:
        ctx = mp.get_context("fork")
        self.conn, child_end = ctx.Pipe()
        # Forking a process that runs JAX's or our own threads warns; the children run
        # only this module's code and the region's, and exit without touching JAX.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.proc = ctx.Process(target=_main, args=(fn, child_end, uid, args), daemon=True)
            self.proc.start()
        child_end.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def recv(self, timeout: float = 60.0):
        if not self.conn.poll(timeout):
            raise AssertionError(f"child {self.pid} said nothing within {timeout} s")
        msg = self.conn.recv()
        if isinstance(msg, ChildFailed):
            raise AssertionError(f"child {self.pid} failed:\n{msg.text}")
        return msg

    def send(self, msg) -> None:
        self.conn.send(msg)

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def stop(self) -> None:
        """SIGSTOP, returning once the child is stopped (signals arrive asynchronously)."""
        self.signal(signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with open(f"/proc/{self.pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "T":
                    return
            time.sleep(0.01)
        raise AssertionError(f"child {self.pid} did not stop")

    def kill(self) -> int | None:
        if self.proc.is_alive():
            self.signal(signal.SIGKILL)
        self.proc.join(30)
        return self.proc.exitcode

    def join(self, timeout: float = 60.0) -> int | None:
        self.proc.join(timeout)
        return self.proc.exitcode

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
        self.conn.close()
        self.proc.close()


def memfd_mappers(tag: str) -> list[int]:
    """Pids of the processes that still map or hold a memfd whose name contains `tag`."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone, or not ours to read
        held = maps.count(tag) > 0
        for fd in fds:
            with contextlib.suppress(OSError):
                held = held or tag in os.readlink(f"/proc/{pid}/fd/{fd}")
        if held:
            out.append(int(pid))
    return out


def shm_entries(token: str) -> list[str]:
    """Entries of /dev/shm whose name contains `token` (other tests run beside us)."""
    try:
        return [e for e in os.listdir("/dev/shm") if token in e]
    except FileNotFoundError:
        return []
