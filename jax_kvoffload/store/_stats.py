"""Usage statistics of the host store, with vLLM 0.33.0's metric names
(``kv_connector/v1/offloading/metrics.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["ALLOCATION_SIZE_BUCKETS", "METRIC_NAMES", "StoreCounters", "StoreStats"]

# vLLM's histogram buckets for ``vllm:kv_offload_cpu_allocation_size`` (powers of 4).
ALLOCATION_SIZE_BUCKETS: tuple[int, ...] = tuple(4**i for i in range(10))

# StoreStats field -> the Prometheus metric vLLM's CPU tier exports for it.
METRIC_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "cpu_cache_usage_perc": "vllm:kv_offload_cpu_cache_usage_perc",
        "cpu_cache_write_usage_perc": "vllm:kv_offload_cpu_cache_write_usage_perc",
        "cpu_cache_read_usage_perc": "vllm:kv_offload_cpu_cache_read_usage_perc",
        "cpu_allocation_size": "vllm:kv_offload_cpu_allocation_size",
        "stores_skipped": "vllm:kv_offload_stores_skipped",
    }
)


@dataclasses.dataclass(slots=True)
class StoreCounters:
    """Cumulative counts since the store was built (never drained, kept by reset).

    Counters only grow, as Prometheus counters do: take differences between two
    snapshots for a rate. ``HostStore.counters()`` returns a copy.

    Attributes:
      lookup_hits: ``lookup`` calls answered HIT (stored and readable).
      lookup_hits_pending: ``lookup`` calls answered HIT_PENDING (store in flight).
      lookup_misses: ``lookup`` calls answered MISS.
      evictions: Keys evicted by ``prepare_store`` to make room.
      stores_completed: Keys made readable by ``complete_store(success=True)``.
      stores_failed: Keys freed by ``complete_store(success=False)``.
      allocation_failures: ``prepare_store`` calls that returned None (vLLM's
        scheduler counts these as ``vllm:kv_offload_allocation_failure``).
    """

    lookup_hits: int = 0
    lookup_hits_pending: int = 0
    lookup_misses: int = 0
    evictions: int = 0
    stores_completed: int = 0
    stores_failed: int = 0
    allocation_failures: int = 0

    @property
    def lookups(self) -> int:
        """Every ``lookup`` call: hits + pending hits + misses."""
        return self.lookup_hits + self.lookup_hits_pending + self.lookup_misses


@dataclasses.dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot returned by ``HostStore.get_stats()``.

    Gauges are fractions of ``num_chunks`` (0.0 when the store has no chunks).
    Per-interval values cover the time since the previous ``get_stats()`` call;
    ``counters`` are cumulative.

    Attributes:
      cpu_cache_usage_perc: vLLM's definition: chunks not reclaimable now (allocated
        minus free minus evictable), i.e. write-pending plus pinned by loads, over
        ``num_chunks``. A store full of idle chunks reads 0.0; see ``occupancy_perc``.
      cpu_cache_write_usage_perc: Write-pending chunks (stores in flight) over
        ``num_chunks``.
      cpu_cache_read_usage_perc: ``max(usage - write_usage, 0)``: chunks pinned by loads.
      cpu_allocation_size: The size of each successful or failed allocation attempt of
        ``prepare_store`` (number of keys to store) since the last call, in call order.
        vLLM observes these into a histogram with ``ALLOCATION_SIZE_BUCKETS``.
      stores_skipped: Keys left unstored by the reuse threshold since the last call;
        None when ``store_threshold < 2`` (vLLM does not export the metric then).
      num_chunks: Chunks in the pool.
      occupied_chunks: Chunks holding a key now: ready (idle or pinned) or
        write-pending. (A key offered twice in one ``prepare_store`` strands a chunk
        until ``reset_cache``, as in vLLM; it counts as occupied.)
      occupancy_perc: ``occupied_chunks / num_chunks`` (0.0 with no chunks).
      counters: Cumulative lookups, hits, misses, evictions and store outcomes.
    """

    cpu_cache_usage_perc: float
    cpu_cache_write_usage_perc: float
    cpu_cache_read_usage_perc: float
    cpu_allocation_size: tuple[int, ...]
    stores_skipped: int | None
    num_chunks: int = 0
    occupied_chunks: int = 0
    occupancy_perc: float = 0.0
    counters: StoreCounters = dataclasses.field(default_factory=StoreCounters)
