"""One stats snapshot of an offloader: what was looked up, moved, kept and dropped.

`KVOffloader.stats()` and the vLLM plug-in (`JaxOffloadingSpec.stats()`) return an
`OffloadStats`. Counters are cumulative since the object was built and never go down
(`reset_cache` forgets chunks, not counts): take `later.since(earlier)` for an
interval, divide by its length for a rate. Gauges (`occupied_chunks`,
`occupancy_perc`, `cpu_cache_usage_perc`) describe the moment of the snapshot.

Taking a snapshot is cheap and safe from any thread: it copies a few integers under a
lock held only for the copy (`TransferTally`), and reads the host store's counters
without draining anything (unlike `HostStore.get_stats`, whose per-interval values
feed vLLM's metrics). Field by field: docs/observability.md.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypedDict

__all__ = [
    "OffloadStats",
    "StoreCountsView",
    "StoreSide",
    "StoreView",
    "TierSource",
    "TierStats",
    "TransferTally",
    "TransferTotals",
    "store_side",
]


@dataclasses.dataclass(frozen=True, slots=True)
class TransferTotals:
    """Cumulative totals of the jobs of one direction (store: device -> host; load:
    host -> device), counted when a job is reported.

    Attributes:
      jobs_completed: jobs reported successful.
      jobs_failed: jobs reported failed (their bytes and seconds are not counted).
      bytes: bytes the successful jobs moved (`TransferResult.size_bytes`; in vLLM,
        `transfer_size`).
      seconds: summed durations of the successful jobs (`TransferResult.seconds`; in
        vLLM, `transfer_time`). Jobs overlap, so this is busy time, not wall time.
    """

    jobs_completed: int = 0
    jobs_failed: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def jobs(self) -> int:
        """Every reported job: completed + failed."""
        return self.jobs_completed + self.jobs_failed

    @property
    def bytes_per_second(self) -> float:
        """`bytes / seconds` of the successful jobs (0.0 before any)."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def since(self, earlier: TransferTotals) -> TransferTotals:
        return TransferTotals(
            self.jobs_completed - earlier.jobs_completed,
            self.jobs_failed - earlier.jobs_failed,
            self.bytes - earlier.bytes,
            self.seconds - earlier.seconds,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class TierStats:
    """Cumulative counters of one secondary tier behind the host store (chunks).

    Attributes:
      name: the tier's medium and index in `secondary_tiers`, e.g. "disk[0]".
      cascaded: chunks written from the host tier to this tier.
      promoted: chunks read from this tier back into the host tier.
      dropped: chunks not cascaded (backpressure, or the tier refused them).
      failed: chunks whose cascade or promotion failed.
    """

    name: str
    cascaded: int = 0
    promoted: int = 0
    dropped: int = 0
    failed: int = 0

    def since(self, earlier: TierStats) -> TierStats:
        return TierStats(
            self.name,
            self.cascaded - earlier.cascaded,
            self.promoted - earlier.promoted,
            self.dropped - earlier.dropped,
            self.failed - earlier.failed,
        )


# Returns the secondary tiers' counters (an engine with tiers sets one on its accounting).
TierSource = Callable[[], Sequence[TierStats]]

# Fields that are gauges (kept as they are by `since`); every other number is a counter.
_GAUGES = frozenset({"num_chunks", "occupied_chunks", "occupancy_perc", "cpu_cache_usage_perc"})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OffloadStats:
    """A snapshot of an offloader (cumulative counters, current gauges).

    Lookups are counted per chunk key, as the host store answers them (`KVOffloader.
    lookup` asks for every whole chunk of the sequence; vLLM's scheduler asks key by
    key and may ask again for a key it found pending).

    Attributes:
      lookups: chunk lookups: hits + hits_pending + misses.
      hits: lookups answered "stored and readable".
      hits_pending: lookups answered "a store of it is in flight".
      misses: lookups answered "not stored".
      hit_tokens: tokens in the chunks answered HIT (per chunk: blocks_per_chunk x the
        group's tokens per block), and with secondary tiers the chunks a
        `KVOffloader.lookup` found in a tier (promoted or being promoted). None where
        the plug-in's groups differ in tokens per chunk (its manager does not see which
        group a key is of).
      prefix_lookups: `KVOffloader.lookup` calls (None for the vLLM plug-in, whose
        scheduler decides how much of a hit it uses).
      prefix_hit_tokens: tokens those calls returned as loadable (the leading hit
        prefix; a sliding-window group's rule included); None for the plug-in.
      store, load: the jobs of each direction (`TransferTotals`).
      stores_completed: chunks made readable by a successful store.
      stores_failed: chunks whose store job failed (freed again, never readable).
      stores_dropped: store offers refused because no room could be made (every
        chunk pinned or write-pending); nothing of such an offer is stored, as in vLLM
        (vLLM counts them as `vllm:kv_offload_allocation_failure`).
      evictions: chunks evicted to make room for new stores.
      resets: `reset_cache` calls.
      num_chunks: chunks the host tier holds at most.
      occupied_chunks: chunks holding a key now (readable, pinned or write-pending).
      occupancy_perc: occupied_chunks / num_chunks (0.0 without chunks).
      cpu_cache_usage_perc: vLLM's `vllm:kv_offload_cpu_cache_usage_perc`: chunks that
        cannot be reclaimed now (write-pending or pinned by loads) over num_chunks. A
        host tier full of idle, readable chunks reads 0.0: see occupancy_perc.
      tiers: one `TierStats` per secondary tier, in configuration order (empty
        without tiers).
      host_copied_stored, host_copied_loaded: KV bytes the host pool copied with the
        CPU, into its rows (stores) and out of them (loads): 0 on the pinned paths of
        an accelerator, each byte once on the others (docs/kernels.md, "Data path").
    """

    lookups: int = 0
    hits: int = 0
    hits_pending: int = 0
    misses: int = 0
    hit_tokens: int | None = 0
    prefix_lookups: int | None = None
    prefix_hit_tokens: int | None = None
    store: TransferTotals = TransferTotals()
    load: TransferTotals = TransferTotals()
    stores_completed: int = 0
    stores_failed: int = 0
    stores_dropped: int = 0
    evictions: int = 0
    resets: int = 0
    num_chunks: int = 0
    occupied_chunks: int = 0
    occupancy_perc: float = 0.0
    cpu_cache_usage_perc: float = 0.0
    tiers: tuple[TierStats, ...] = ()
    host_copied_stored: int = 0
    host_copied_loaded: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / lookups (0.0 before any lookup)."""
        return self.hits / self.lookups if self.lookups else 0.0

    def since(self, earlier: OffloadStats) -> OffloadStats:
        """The counts between `earlier` and this snapshot (gauges: this snapshot's)."""
        # Field name -> a value of that field's own type: one dict for `OffloadStats(**out)`.
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            now, then = getattr(self, f.name), getattr(earlier, f.name)
            if f.name in _GAUGES or now is None or then is None:
                out[f.name] = now
            elif f.name == "tiers":
                before = {t.name: t for t in then}
                out[f.name] = tuple(t.since(before[t.name]) if t.name in before else t for t in now)
            elif isinstance(now, TransferTotals):
                out[f.name] = now.since(then)
            else:
                out[f.name] = now - then
        return OffloadStats(**out)

    def as_dict(self) -> dict[str, object]:
        """JSON-ready: the fields, with `hit_rate`, and per direction `jobs` and
        `bytes_per_second` added."""
        out = dataclasses.asdict(self)
        out["hit_rate"] = self.hit_rate
        for direction in ("store", "load"):
            totals = getattr(self, direction)
            out[direction]["jobs"] = totals.jobs
            out[direction]["bytes_per_second"] = totals.bytes_per_second
        out["tiers"] = [dataclasses.asdict(t) for t in self.tiers]
        return out


class TransferTally:
    """Running `TransferTotals` of both directions; `record` and `totals` may be
    called from any thread (a lock held only while a few numbers are added or copied).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # direction -> [completed, failed, bytes], and its seconds
        self._counts: dict[bool, list[int]] = {True: [0, 0, 0], False: [0, 0, 0]}
        self._seconds: dict[bool, float] = {True: 0.0, False: 0.0}

    def record(self, store: bool, success: bool, size_bytes: int, seconds: float) -> None:
        """Counts one reported job (`store`: True for device -> host)."""
        with self._lock:
            counts = self._counts[store]
            if success:
                counts[0] += 1
                counts[2] += size_bytes
                self._seconds[store] += seconds
            else:
                counts[1] += 1

    def totals(self) -> tuple[TransferTotals, TransferTotals]:
        """(store, load) totals now."""
        with self._lock:
            return self._totals(True), self._totals(False)

    def _totals(self, store: bool) -> TransferTotals:
        completed, failed, size = self._counts[store]
        return TransferTotals(completed, failed, size, self._seconds[store])


class StoreCountsView(Protocol):
    """The cumulative counters `store_side` reads (`jax_kvoffload.store.StoreCounters`)."""

    @property
    def lookups(self) -> int: ...
    @property
    def lookup_hits(self) -> int: ...
    @property
    def lookup_hits_pending(self) -> int: ...
    @property
    def lookup_misses(self) -> int: ...
    @property
    def stores_completed(self) -> int: ...
    @property
    def stores_failed(self) -> int: ...
    @property
    def allocation_failures(self) -> int: ...
    @property
    def evictions(self) -> int: ...


class StoreView(Protocol):
    """What `store_side` reads of a host store (`jax_kvoffload.store.HostStore`): a
    protocol, since stats sits below store (`tests/test_layering.py`)."""

    @property
    def num_chunks(self) -> int: ...
    @property
    def num_occupied_chunks(self) -> int: ...
    @property
    def num_evictable_chunks(self) -> int: ...
    @property
    def cache_generation(self) -> int: ...
    def counters(self) -> StoreCountsView: ...


class StoreSide(TypedDict):
    """The `OffloadStats` fields `store_side` fills (the keyword arguments it gives)."""

    lookups: int
    hits: int
    hits_pending: int
    misses: int
    hit_tokens: int | None
    stores_completed: int
    stores_failed: int
    stores_dropped: int
    evictions: int
    resets: int
    num_chunks: int
    occupied_chunks: int
    occupancy_perc: float
    cpu_cache_usage_perc: float
    tiers: tuple[TierStats, ...]


def store_side(
    store: StoreView, hit_tokens: int | None, tiers: Sequence[TierStats] = ()
) -> StoreSide:
    """The `OffloadStats` fields a `HostStore` answers, read without draining it.

    `store.counters()` copies the cumulative counters; the gauges come from the
    store's chunk counts with vLLM's definitions (`HostStore.get_stats`).
    """
    c = store.counters()
    n = store.num_chunks
    occupied = store.num_occupied_chunks
    busy = occupied - store.num_evictable_chunks  # write-pending or pinned by loads
    # Read from any thread while the caller's thread works: a chunk stored between the
    # two reads would make `busy` negative (or larger than `occupied`); the gauges are
    # kept in their range instead (a lock-free read of a moving store).
    occupied = min(max(occupied, 0), n)
    busy = min(max(busy, 0), occupied)
    return {
        "lookups": c.lookups,
        "hits": c.lookup_hits,
        "hits_pending": c.lookup_hits_pending,
        "misses": c.lookup_misses,
        "hit_tokens": hit_tokens,
        "stores_completed": c.stores_completed,
        "stores_failed": c.stores_failed,
        "stores_dropped": c.allocation_failures,
        "evictions": c.evictions,
        "resets": store.cache_generation,
        "num_chunks": n,
        "occupied_chunks": occupied,
        "occupancy_perc": occupied / n if n else 0.0,
        "cpu_cache_usage_perc": busy / n if n else 0.0,
        "tiers": tuple(tiers),
    }
