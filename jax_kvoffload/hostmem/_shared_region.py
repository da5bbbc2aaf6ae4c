"""Host memory shared by the worker processes of one engine (canonical pages).

With canonical pages, every rank of a TP x PCP group writes its own bytes into the same
host rows and reads its page back from them, so the rows must be one memory for all
worker processes. `SharedHostRegion` gives them one, safely on a machine shared with
other users and without leaving anything behind (docs/security.md):

* The memory is a memfd (`_shm_memfd`): no file in `/dev/shm` or anywhere else, mode
  0600, sealed against resizing, reserved in full when made; the kernel frees it when
  the last process holding it exits, however it exits.
* Processes find each other by abstract Unix-socket names derived from the region's name
  and the user id (`_shm_rendezvous`); every process that has mapped the region serves
  its descriptor to newcomers of the same user (SCM_RIGHTS, credentials checked both
  ways). Joins are serialised by a lock name, so as long as one process holds the
  memory, no other creates a second one: the ranks of an engine share one memory, or a
  join fails with a typed error.
* The region is sized for `expected_attachments` processes; each takes one slot (its
  rank when given) and marks it in the header, which `attachments()` counts. One process
  too many, or two claiming one rank, is an error.
* Every wait is bounded (`timeout`).
"""

from __future__ import annotations

import logging
import math
import mmap
import operator
import os
import time
from typing import TYPE_CHECKING, SupportsIndex, cast

import numpy as np

from jax_kvoffload.hostmem import _shm_memfd, _shm_rendezvous
from jax_kvoffload.hostmem._shm_errors import (
    ForeignPeerError,
    SharedRegionArgumentError,
    SharedRegionError,
    SharedRegionTimeoutError,
)

if TYPE_CHECKING:
    import socket

__all__ = [
    "HEADER_BYTES",
    "ForeignPeerError",
    "SharedHostRegion",
    "SharedRegionArgumentError",
    "SharedRegionError",
    "SharedRegionTimeoutError",
]

logger = logging.getLogger(__name__)

HEADER_BYTES = _shm_memfd.HEADER_BYTES
MAX_ATTACHMENTS = _shm_memfd.MAX_ATTACHMENTS
_FETCH_TIMEOUT_S = 5.0  # one holder's answer: it serves from a thread in milliseconds


def default_timeout(nbytes: int) -> float:
    """The bound on waiting for another process: a minute, plus two seconds per GiB for
    a creator that is still reserving (zeroing) the pages of a large region."""
    return 60.0 + 2.0 * nbytes / (1 << 30)


def memfd_name(name: str) -> str:
    """The name the region's memory shows in `/proc/<pid>/maps` (readable by its user and
    root only): a digest, so it does not reveal the region's name."""
    return _shm_memfd.MEMFD_PREFIX + _shm_rendezvous.address(name, "memfd")[-16:].decode()


class SharedHostRegion:
    """`nbytes` of host memory shared by `expected_attachments` processes of one user.

    Args:
      name: the region's name, the same in every process of one run and in no other run
        (vLLM: derived from the `engine_id`, a random uuid unless set). Another user who
        can guess it can deny service, never read or write the memory.
      nbytes: data bytes (every attaching process must agree).
      expected_attachments: how many processes will map it (at most 256).
      rank: this process's index in `[0, expected_attachments)`; two live processes with
        one rank are an error. None: the first free slot.
      timeout: the bound, in seconds, on every wait for another process (default
        `default_timeout(nbytes)`); a wait that runs out is a `SharedRegionTimeoutError`.

    `array` is the data as a writable uint8 numpy array. `close()` stops serving the
    region and unmaps it (views must be dropped first); the memory is freed when every
    process has closed it or exited. Linux only.
    """

    def __init__(
        self,
        name: str,
        nbytes: int,
        expected_attachments: int,
        *,
        rank: int | None = None,
        timeout: float | None = None,
    ) -> None:
        nbytes, expected, rank = _check_arguments(name, nbytes, expected_attachments, rank)
        wait = default_timeout(nbytes) if timeout is None else _check_timeout(timeout)
        reason = _shm_memfd.unsupported()
        if reason is not None:
            raise SharedRegionError(reason)
        self.name = name
        self.nbytes = nbytes
        self.expected_attachments = expected
        self.created = False
        self.slot = -1
        self._label = f"shared host region {name!r}"
        self.memfd_name = memfd_name(name)
        self._fd = -1
        self._mmap: mmap.mmap | None = None
        self._server: _shm_rendezvous.FdServer | None = None
        deadline = time.monotonic() + wait
        lock = _shm_rendezvous.acquire_lock(self._address("lock"), deadline, self._label)
        try:
            self._join(deadline, rank)
        except BaseException:  # on any exit: the descriptor, mapping and server go
            self._release()
            raise
        finally:
            lock.close()
        self.array = np.frombuffer(
            cast(mmap.mmap, self._mmap), dtype=np.uint8, offset=HEADER_BYTES, count=nbytes
        )

    def _address(self, role: str) -> bytes:
        return _shm_rendezvous.address(self.name, role)

    def _join(self, deadline: float, rank: int | None) -> None:
        """Under the lock: maps the memory a live holder serves, or makes it when nobody
        holds it; then takes a slot and serves the memory to those who come later."""
        fd = self._fetch_from_holders(deadline)
        if fd is None:
            fd = _shm_memfd.create(
                self.nbytes, self.expected_attachments, self.memfd_name, self._label
            )
            self.created = True
        self._fd = fd
        if not self.created:
            _shm_memfd.verify(fd, self.nbytes, self.expected_attachments, self._label)
        self._mmap = mmap.mmap(fd, HEADER_BYTES + self.nbytes, mmap.MAP_SHARED)
        listener, self.slot = self._claim_slot(rank)
        try:
            self._mmap[_shm_memfd.SLOTS_OFFSET + self.slot] = 1
            self._server = _shm_rendezvous.FdServer(listener, fd, self._label)
        except BaseException:  # on any exit: the listening socket is closed
            listener.close()
            raise
        logger.info(
            "%s: %s %d bytes as slot %d of %d",
            self._label,
            "created" if self.created else "joined",
            self.nbytes,
            self.slot,
            self.expected_attachments,
        )

    def _fetch_from_holders(self, deadline: float) -> int | None:
        """The descriptor from any process holding the region, or None when none does.

        Every slot name is asked, beyond `expected_attachments` too, so a holder that
        was sized differently is found (and refused by the size check) instead of
        ignored. A holder that is alive but silent is waited for, never bypassed: making
        a new memory beside it would split the ranks."""
        while True:
            silent = None
            for slot in range(MAX_ATTACHMENTS):
                remaining = deadline - time.monotonic()
                fd, holder = _shm_rendezvous.fetch(
                    self._address(f"slot{slot}"), min(remaining, _FETCH_TIMEOUT_S), self._label
                )
                if fd is not None:
                    return fd
                silent = silent or holder
            if silent is None:
                return None
            if time.monotonic() >= deadline:
                who = f"process {silent.pid}" if silent.pid > 0 else "a process"
                raise SharedRegionTimeoutError(
                    f"{self._label}: {who} holds it but did not hand it over before the "
                    "timeout (stopped or hung?); a new region beside it would split the "
                    "ranks. Stop that process, or pass a larger timeout",
                    pid=silent.pid if silent.pid > 0 else None,
                )
            time.sleep(0.05)

    def _claim_slot(self, rank: int | None) -> tuple[socket.socket, int]:
        if rank is None:  # slots never marked first, so a reused one does not undercount
            start = _shm_memfd.SLOTS_OFFSET
            marks = cast(mmap.mmap, self._mmap)[start : start + self.expected_attachments]
            slots = sorted(range(self.expected_attachments), key=lambda s: marks[s] != 0)
        else:
            slots = [rank]
        for slot in slots:
            listener = _shm_rendezvous.bind(self._address(f"slot{slot}"))
            if listener is not None:
                return listener, slot
        taken = [_shm_rendezvous.probe(self._address(f"slot{s}")) for s in slots]
        for peer in taken:
            if peer is not None:
                _shm_rendezvous.refuse_foreign(peer, self._label, "slot")
        if rank is not None:
            who = f"process {taken[0].pid}" if taken[0] else "a process that does not answer"
            raise SharedRegionError(
                f"{self._label}: rank {rank} is already attached by {who}; two live "
                "processes claim one rank (two engines sharing one name, e.g. the same "
                "vLLM engine_id, or an old worker still running). Stop it or use another name"
            )
        raise SharedRegionError(
            f"{self._label} was sized for {self.expected_attachments} processes and all "
            "of them are attached; this process would be one more. Every process must pass "
            "the same expected_attachments (vLLM: the world size), and names must differ "
            "between runs"
        )

    def attachments(self) -> tuple[int, int]:
        """`(attached, expected)`: how many processes have mapped the region so far."""
        if self._mmap is None:
            raise SharedRegionError(f"{self._label} is closed")
        start = _shm_memfd.SLOTS_OFFSET
        marks = self._mmap[start : start + self.expected_attachments]
        return len(marks) - marks.count(0), self.expected_attachments

    def close(self) -> None:
        """Stops serving the region and unmaps this process's view (idempotent). With
        numpy views of `array` still alive the memory stays mapped until they are gone;
        it is freed when no process holds it any more."""
        if self._mmap is None and self._fd < 0:
            return
        # `array` is typed for the open region, the only state it may be read in.
        self.array = None  # type: ignore[assignment]
        self._release()

    def _release(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                logger.debug("%s still has views; unmapped when they go", self._label)
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SharedHostRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._mmap is None else f"slot {self.slot}"
        return (
            f"SharedHostRegion({self.name!r}, {self.nbytes}, {self.expected_attachments}, {state})"
        )


def _check_arguments(
    name: object, nbytes: object, expected: object, rank: object
) -> tuple[int, int, int | None]:
    if not isinstance(name, str) or not name:
        raise SharedRegionArgumentError(f"name must be a non-empty string; got {name!r}")
    try:
        name.encode()  # the socket names hash its UTF-8 bytes
    except UnicodeEncodeError:
        raise SharedRegionArgumentError(
            f"name must be encodable as UTF-8 (no lone surrogates); got {name!r:.80}"
        ) from None
    try:
        values = [operator.index(cast(SupportsIndex, v)) for v in (nbytes, expected)]
        rank = None if rank is None else operator.index(cast(SupportsIndex, rank))
    except TypeError:
        raise SharedRegionArgumentError(
            "nbytes, expected_attachments and rank must be integers; got "
            f"{nbytes!r}, {expected!r}, {rank!r}"
        ) from None
    nbytes, expected = values
    if nbytes < 0:
        raise SharedRegionArgumentError(f"nbytes must be >= 0; got {nbytes}")
    if not 1 <= expected <= MAX_ATTACHMENTS:
        raise SharedRegionArgumentError(
            f"expected_attachments must be in [1, {MAX_ATTACHMENTS}]; got {expected}"
        )
    if rank is not None and not 0 <= rank < expected:
        raise SharedRegionArgumentError(
            f"rank must be in [0, expected_attachments={expected}); got {rank}"
        )
    return nbytes, expected, rank


def _check_timeout(timeout: object) -> float:
    try:
        value = float(timeout)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(timeout, bool) or not 0 <= value < math.inf:
        raise SharedRegionArgumentError(
            f"timeout must be a finite number of seconds >= 0, or None; got {timeout!r}"
        )
    return value
