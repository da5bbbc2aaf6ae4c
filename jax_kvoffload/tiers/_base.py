"""The abstract secondary tier, its job results and its counters."""

from __future__ import annotations

import concurrent.futures as cf
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from jax_kvoffload.errors import KVOffloadTypeError, KVOffloadValueError
from jax_kvoffload.tiers._checks import check_keys
from jax_kvoffload.tiers._errors import TierClosedError

__all__ = ["KeyFlags", "SecondaryTier", "TierCounters", "TierJobResult"]

if TYPE_CHECKING:
    from typing import TypeAlias

    from typing_extensions import Buffer as _BufferProtocol

    # Any object exporting a contiguous buffer: bytes, memoryview, a numpy array (whose
    # stubs declare the buffer protocol on Python 3.12+ only: `memoryview(buf)` of a
    # `Buffer` takes `# type: ignore[arg-type]` for that reason).
    Buffer: TypeAlias = _BufferProtocol | np.ndarray
else:
    Buffer = Any  # (typing_extensions is not a runtime dependency)

_NONE = object()


_AMBIGUOUS = (
    "{what} has no truth value: a job of several keys can succeed for some and fail for "
    "others; use .all_ok (every key stored or loaded, not dropped), .ok_keys / "
    ".failed_keys (which ones), or compare .ok with a tuple of booleans"
)


class KeyFlags(tuple[bool, ...]):
    """`TierJobResult.ok`: one bool per key, in submission order; a tuple that refuses
    to be read as one truth value (`if result.ok:` was true for a job whose every key
    failed: a non-empty tuple is truthy)."""

    __slots__ = ()

    def __bool__(self) -> bool:
        raise KVOffloadTypeError(_AMBIGUOUS.format(what="TierJobResult.ok (one flag per key)"))


@dataclass(frozen=True)
class TierJobResult:
    """How one store or load job ended.

    Read it with `all_ok` (did every key succeed?), `ok_keys` / `failed_keys` (which
    ones), or `ok` (one flag per key). Neither the result nor `ok` has a truth value:
    `assert result.ok` or `if result:` raise `KVOffloadTypeError` instead of passing for
    a job whose keys failed.

    Attributes:
      kind: "store" or "load".
      keys: the job's keys, in submission order.
      ok: per key (a `KeyFlags` tuple): stored (a store; "already there" counts) or
        loaded with verified bytes (a load). A False load leaves that key's `out` buffer
        unspecified.
      dropped: a store refused whole under backpressure (nothing was written).
      nbytes: payload bytes moved.
      seconds: wall time from submission to completion.
    """

    kind: str
    keys: tuple[bytes, ...]
    ok: tuple[bool, ...]
    dropped: bool = False
    nbytes: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        # A third-party tier builds these: a flag that is not a bool ("no" is truthy), or
        # fewer flags than keys, would read as success or fail later, far from the tier.
        if self.kind not in ("store", "load"):
            raise KVOffloadValueError(
                f"TierJobResult.kind={self.kind!r} must be 'store' or 'load'; pass the job's"
            )
        if isinstance(self.keys, (str, bytes)) or not isinstance(self.keys, Iterable):
            raise KVOffloadTypeError(
                f"TierJobResult.keys must be a tuple of the job's keys (bytes), got "
                f"{type(self.keys).__name__}; pass the keys the job was given"
            )
        if isinstance(self.ok, (bool, np.bool_)) or not isinstance(self.ok, Iterable):
            raise KVOffloadTypeError(
                f"TierJobResult.ok must be one bool per key, got {type(self.ok).__name__} "
                f"{self.ok!r:.40}; pass e.g. (True,) * len(keys)"
            )
        keys, ok = tuple(self.keys), tuple(self.ok)
        bad = next((f for f in ok if not isinstance(f, (bool, np.bool_))), _NONE)
        if bad is not _NONE or len(ok) != len(keys):
            raise KVOffloadValueError(
                f"TierJobResult.ok must be one bool per key ({len(keys)} keys), got "
                f"{len(ok)} flags{'' if bad is _NONE else f' including {bad!r:.40}'}; pass "
                "True or False for each key, in submission order"
            )
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "ok", KeyFlags(bool(f) for f in ok))

    def __bool__(self) -> bool:
        raise KVOffloadTypeError(_AMBIGUOUS.format(what="a TierJobResult"))

    @property
    def all_ok(self) -> bool:
        """Every key stored (or loaded, verified) and the job not dropped."""
        return all(self.ok) and not self.dropped

    @property
    def ok_keys(self) -> tuple[bytes, ...]:
        """The keys that succeeded, in submission order."""
        return tuple(k for k, ok in zip(self.keys, self.ok, strict=True) if ok)

    @property
    def failed_keys(self) -> tuple[bytes, ...]:
        """The keys that failed (missed, or were dropped), in submission order."""
        return tuple(k for k, ok in zip(self.keys, self.ok, strict=True) if not ok)


@dataclass(frozen=True)
class TierCounters:
    """A snapshot of a tier's counters (since it was opened) and occupancy: what
    `SecondaryTier.stats()` returns (the offloader's view of a tier, chunks cascaded and
    promoted, is `jax_kvoffload.stats.TierStats`).

    `stores_dropped` / `keys_dropped`: store jobs / keys refused under backpressure or
    while the backend was down. `corrupt`: entries that failed a check on read (removed
    where the tier can remove them). `errors`: I/O or connection failures.
    """

    stores_submitted: int = 0
    stores_dropped: int = 0
    keys_dropped: int = 0
    keys_stored: int = 0
    keys_already_present: int = 0
    store_failures: int = 0
    bytes_written: int = 0
    loads_submitted: int = 0
    load_hits: int = 0
    load_misses: int = 0
    bytes_read: int = 0
    lookups: int = 0
    lookup_hits: int = 0
    corrupt: int = 0
    errors: int = 0
    evictions: int = 0
    bytes_evicted: int = 0
    entries: int = 0
    bytes_used: int = 0


class Counters:
    """Thread-safe counters behind `TierCounters` (implementations add to them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = {f.name: 0 for f in fields(TierCounters)}

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def set(self, **values: int) -> None:
        with self._lock:
            self._values.update(values)

    def snapshot(self) -> TierCounters:
        with self._lock:
            return TierCounters(**self._values)


class SecondaryTier(ABC):
    """A store of chunk payloads behind the host tier, keyed by offload keys.

    Contract, for every implementation:

    - **Entries, bytes in and out.** An entry maps (the tier's namespace, a key) to
      payload bytes; keys are offload keys (block hash + 4-byte group index, at most
      1024 bytes). Every entry carries the header of `_entry.py`; a read checks
      namespace, key, length and both CRC32Cs. A hit delivers exactly the bytes stored;
      anything else (absent, another namespace, torn, corrupted, evicted meanwhile) is a
      miss, and a bad entry is removed. Never a wrong byte, whatever crashed when.
    - **Atomicity.** Storing one key is atomic: a reader sees no entry or the whole
      entry. A job of several keys is not: each key succeeds or fails alone
      (`TierJobResult.ok`). Storing a key that exists succeeds without rewriting it or
      overwrites it with the same bytes.
    - **Asynchrony.** `submit_store` / `submit_load` return a `concurrent.futures.Future`
      at once; the I/O runs on the tier's own threads, loads and stores on separate
      ones, so loads never wait behind stores. `lookup_async` never blocks;
      `contains` blocks for at most the tier's timeouts.
    - **Backpressure.** A store the tier cannot take now (too many bytes queued, the
      backend down) is dropped: its future is already done with `dropped=True`, and
      `TierCounters.stores_dropped` counts it. Submitting never waits for I/O.
    - **Buffers.** A payload given to `submit_store` must stay valid and unchanged
      until its future is done (the caller pins its host row). The `out` buffers of
      `submit_load` are written by the tier's threads until the future is done; a key
      that missed leaves its buffer unspecified (it may hold part of a rejected entry).
    - **Threads.** Every method may be called from any thread, concurrently. Failures
      inside jobs never raise to the caller: they are misses / failed keys, logged once
      per kind and counted. Only a caller's error found inside a load job raises, from
      its future once every key finished: an `out` buffer whose length is not that of
      the entry its key holds, as the entry's header says (`TierBufferSizeError`, the
      job's result in `.result`; the entry is kept). Each job's future completes exactly
      once, also on `close()` (queued jobs then fail).
    - **Bounded.** No call waits without bound: I/O has timeouts (network) or is a local
      syscall; `drain(timeout)` and `close()` wait only for running I/O.
    - **Opening.** The class a registered `TierKind` names is opened as
      `cls(config, namespace, describe=None)`: its kind's configuration, the 32-byte
      namespace digest, and `namespace_fields` in words (for operators; a tier may
      ignore it). `medium` says where its bytes live.
    """

    #: Where the bytes live: "disk" (this machine) or "remote" (a server others share).
    #: Tags the offloader's transfers; in vLLM, "remote" is locality REMOTE and hits
    #: of an external source.
    medium: ClassVar[str] = ""

    def __init__(self, namespace: bytes) -> None:
        if not isinstance(namespace, bytes) or len(namespace) != 32:
            got = f"{len(namespace)} bytes" if isinstance(namespace, bytes) else type(namespace)
            raise KVOffloadTypeError(
                f"namespace must be the 32-byte digest of namespace_digest(config), got {got}"
            )
        self._namespace = namespace
        self._counters = Counters()
        self._lookup_pool: cf.ThreadPoolExecutor | None = None
        self._lookup_lock = threading.Lock()
        self._closed = False  # no new work
        self._close_done = False  # threads joined, descriptors closed
        self._close_lock = threading.RLock()

    @property
    def namespace(self) -> bytes:
        """The 32-byte namespace digest every entry of this tier carries."""
        return self._namespace

    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key has an entry now (a later load may still miss: an entry
        can be evicted or found corrupt in between). Errors answer False."""

    @abstractmethod
    def submit_store(self, items: Sequence[tuple[bytes, Buffer]]) -> cf.Future[TierJobResult]:
        """Stores `(key, payload)` pairs; returns at once (see the class contract)."""

    @abstractmethod
    def submit_load(self, items: Sequence[tuple[bytes, Buffer]]) -> cf.Future[TierJobResult]:
        """Loads each key's payload into its writable `out` buffer of the exact payload
        length; a key whose entry is absent or fails a check is a miss (and the entry
        removed); a whole entry of another length is kept and the future raises
        `TierBufferSizeError`."""

    @abstractmethod
    def drain(self, timeout: float | None = None) -> bool:
        """Waits until every submitted job has completed; False if `timeout` ran out."""

    @abstractmethod
    def _close_io(self) -> None:
        """Stops the I/O threads (running I/O finishes; queued jobs fail). Must be
        idempotent: after an interrupt, `close()` calls it again."""

    def lookup_async(self, keys: Sequence[bytes]) -> cf.Future[list[bool]]:
        """`contains(keys)` on the tier's lookup thread; never blocks the caller."""
        self._check_open()
        keys = self._check_lookup_keys(keys)
        with self._lookup_lock:
            self._check_open()  # again: close() may have shut the pool down meanwhile
            if self._lookup_pool is None:
                self._lookup_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="tier-lookup")
            return self._lookup_pool.submit(self.contains, keys)

    def _check_lookup_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys a lookup takes, checked now (not on the lookup thread)."""
        return check_keys(keys)

    def stats(self) -> TierCounters:
        """Counters since the tier was opened, and its occupancy."""
        return self._counters.snapshot()

    def close(self) -> None:
        """Stops the tier's threads; idempotent, and safe from several threads. Stored
        entries persist. It waits for running I/O: interrupted there (Ctrl-C), new work
        is already refused and the next `close()` finishes the job."""
        with self._close_lock:
            if self._close_done:
                return
            self._closed = True
            with self._lookup_lock:
                pool = self._lookup_pool
            if pool is not None:  # forgotten only once shut down: an interrupt may come
                pool.shutdown(wait=True, cancel_futures=True)
                self._lookup_pool = None
            self._close_io()  # idempotent: a second call completes an interrupted one
            self._close_done = True

    def __enter__(self) -> SecondaryTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError(f"{type(self).__name__} is closed; open a new one")
