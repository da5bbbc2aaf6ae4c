"""The Mooncake tier's side of Mooncake: the client (imported lazily), its result codes,
the master's health, and the memory Mooncake may move rows from and into.

Mooncake's Python client (`mooncake.store.MooncakeDistributedStore`, package
`mooncake-transfer-engine-non-cuda`) answers each key of a batch call with an int: 0 or
the bytes read for success, a negative `ErrorCode` otherwise. Those this tier tells
apart (seen from 0.3.13.post1; `mooncake-store/include/types.h`):

| code | name | what the tier does |
| --- | --- | --- |
| -200 | NO_AVAILABLE_HANDLE | no segment has room: the store fails (counted) |
| -600 | BUFFER_OVERFLOW | the entry is longer than the buffers: its size is asked |
| -704 | OBJECT_NOT_FOUND | a miss |
| -706 | OBJECT_HAS_LEASE | a removal waits for a reader's lease: forced |
| -800 | TRANSFER_FAIL | a segment's node is gone or the buffers are too long: asked |
| -900 | RPC_FAIL | the master does not answer: down for `retry_after_s` |
| -901 | RPC_TIMEOUT | the master hangs (stopped, a partition): down, as RPC_FAIL |
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from jax_kvoffload._log_once import log_once, reset_log_once
from jax_kvoffload.tiers._base import Counters
from jax_kvoffload.tiers._errors import TierStateError

if TYPE_CHECKING:
    from jax_kvoffload.tiers._base import Buffer

__all__ = [
    "PACKAGE",
    "BufferRegistry",
    "MasterHealth",
    "MooncakeUnavailableError",
    "Regions",
    "address_of",
    "code_name",
    "import_store",
    "probe",
]

logger = logging.getLogger("jax_kvoffload.tiers._mooncake")

PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
NOT_FOUND = -704
NO_SPACE = -200
BUFFER_OVERFLOW = -600
HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901  # each such call waits Mooncake's RPC timeout (~30 s)
# The master did not answer: it is marked down, and no further call asks it meanwhile.
MASTER_DOWN = frozenset((RPC_FAIL, RPC_TIMEOUT))
_NAMES = {
    NO_SPACE: "NO_AVAILABLE_HANDLE (no segment has room)",
    BUFFER_OVERFLOW: "BUFFER_OVERFLOW",
    NOT_FOUND: "OBJECT_NOT_FOUND",
    HAS_LEASE: "OBJECT_HAS_LEASE",
    TRANSFER_FAIL: "TRANSFER_FAIL (a segment's node did not answer)",
    RPC_FAIL: "RPC_FAIL (the master did not answer)",
    RPC_TIMEOUT: "RPC_TIMEOUT (the master did not answer in time)",
}
_MAX_RETRY_S = 30.0
# A buffer's exporter at least this large (a host pool, vLLM's primary view) is
# registered with Mooncake once, whole; smaller ones are a caller's scratch rows.
REGISTER_MIN_BYTES = 4 << 20
# Exporters registered on first use, at most (each stays referenced until close): a
# caller handing ever new large buffers must not pin them all.
MAX_AUTO_REGIONS = 16


class MooncakeUnavailableError(TierStateError):
    """Mooncake's client cannot be imported, or does not reach its master at opening."""


def code_name(code: int) -> str:
    return _NAMES.get(code, f"error {code}")


def import_store() -> Any:  # Mooncake's package has no types
    """The `MooncakeDistributedStore` class; a typed error naming the package if absent."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:  # the package, or one of its libraries (libibverbs1, ...)
        raise MooncakeUnavailableError(
            f"the Mooncake tier needs Mooncake's Python client, which does not import here "
            f"({e}); install it: pip install '{PACKAGE}' (or the `mooncake` extra; and, on "
            "Debian/Ubuntu, apt-get install libibverbs1 librdmacm1 libnuma1)"
        ) from None
    return MooncakeDistributedStore


def probe(address: tuple[str, int], timeout: float, key: str) -> None:
    """Connects to `address` once (then closes); a typed error if nothing answers."""
    try:
        socket.create_connection(address, timeout).close()
    except OSError as e:
        host, port = address
        raise MooncakeUnavailableError(
            f"MooncakeTierConfig.{key}: nothing answers at {host}:{port} within {timeout:g} s "
            f"({e}); start mooncake_master there or fix {key}"
        ) from None


def address_of(view: memoryview) -> int:
    """The address of a contiguous buffer's first byte (no copy)."""
    return np.frombuffer(view, np.uint8).ctypes.data if len(view) else 0


def _root(buf: Buffer) -> Buffer:
    """The object that owns `buf`'s memory (a numpy view's base, a memoryview's owner)."""
    obj = memoryview(buf).obj  # type: ignore[arg-type]
    while True:
        base = getattr(obj, "base", None) if isinstance(obj, np.ndarray) else None
        if isinstance(obj, memoryview):
            base = obj.obj
        if base is None:
            return obj
        obj = base


class BufferRegistry(Protocol):
    """The part of Mooncake's `MooncakeDistributedStore` that registers memory with its
    transfer engine (`Regions`, the tier's scratch); each returns 0 or an error code."""

    def register_buffer(self, addr: int, size: int, /) -> int: ...
    def unregister_buffer(self, addr: int, /) -> int: ...


class Regions:
    """The memory registered with Mooncake (`register_buffer`): a buffer's whole
    exporter, once, when it is large (a host pool's rows; at most `MAX_AUTO_REGIONS`
    so, more by `register`); `close()` unregisters them. Registered exporters are kept
    referenced, so their addresses stay theirs."""

    def __init__(self, store: BufferRegistry) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._regions: dict[int, tuple[Buffer, int, int]] = {}  # id(root) -> (root, addr, n)

    def register(self, buf: Buffer) -> bool:
        """Registers `buf`'s exporter (any size); False if Mooncake refused it."""
        root = _root(buf)
        with self._lock:
            if id(root) in self._regions:
                return True
            a = np.frombuffer(root, np.uint8)  # type: ignore[arg-type]
            addr, n = a.ctypes.data, a.nbytes
            del a
            rc = self._store.register_buffer(addr, n)
            if rc != 0:
                log_once(logger, "mooncake-register", "mooncake tier: register_buffer of %d "
                         "bytes failed (%s); its rows are staged", n, code_name(rc))  # fmt: skip
                return False
            self._regions[id(root)] = (root, addr, n)
            return True

    def covers(self, view: memoryview, addr: int) -> bool:
        """Whether `view` (at `addr`) lies in registered memory; registers its exporter
        first if that is large."""
        try:
            root = _root(view)
        except (TypeError, ValueError):
            return False
        entry = self._regions.get(id(root))
        if entry is None:
            try:
                n = memoryview(root).nbytes  # type: ignore[arg-type]
            except (TypeError, ValueError):
                return False
            if n < REGISTER_MIN_BYTES or len(self._regions) >= MAX_AUTO_REGIONS:
                return False
            if not self.register(view):
                return False
            entry = self._regions[id(root)]
        _, start, n = entry
        return start <= addr and addr + len(view) <= start + n

    def close(self) -> None:
        with self._lock:
            regions, self._regions = self._regions, {}
        for _, addr, _ in regions.values():
            self._store.unregister_buffer(addr)


class MasterHealth:
    """Whether the master answers: after an RPC failure it is down for `retry_after_s`
    (doubling to 30 s while it stays down); loads miss and stores drop meanwhile. One
    warning per outage, one line when it answers again."""

    def __init__(self, retry_after_s: float, counters: Counters, where: str) -> None:
        self._retry = retry_after_s
        self._backoff = retry_after_s
        self._until = 0.0
        self._down = False
        self._counters = counters
        self._where = where
        self._lock = threading.Lock()

    def up(self) -> bool:
        return time.monotonic() >= self._until

    @property
    def down(self) -> bool:
        """Failed and not answered since (back-off over or not)."""
        return self._down

    def failed(self) -> None:
        self._counters.add(errors=1)
        now = time.monotonic()
        with self._lock:
            if self._down and now < self._until:
                return  # another call of the same outage
            first = not self._down
            self._backoff = self._retry if first else min(2 * self._backoff, _MAX_RETRY_S)
            self._until = now + self._backoff
            self._down = True
        if first:
            log_once(logger, "mooncake-master-down", "mooncake tier: the master at %s does "
                     "not answer; loads miss and stores are dropped, retrying every %.1f s "
                     "(up to %.0f s)", self._where, self._retry, _MAX_RETRY_S)  # fmt: skip

    def answered(self) -> None:
        if not self._down:
            return
        with self._lock:
            was, self._down, self._backoff, self._until = self._down, False, self._retry, 0.0
        if was:
            logger.warning("mooncake tier: the master at %s answers again", self._where)
            reset_log_once("mooncake-master-down")
