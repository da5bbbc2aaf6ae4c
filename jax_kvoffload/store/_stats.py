"""Usage statistics of the host store, with vLLM 0.33.0's metric names
(``kv_connector/v1/offloading/metrics.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["ALLOCATION_SIZE_BUCKETS", "METRIC_NAMES", "StoreStats"]

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


@dataclasses.dataclass(frozen=True, slots=True)
class StoreStats:
    """A snapshot returned by ``HostStore.get_stats()``.

    Gauges are fractions of ``num_chunks`` (0.0 when the store has no chunks).
    Per-interval values cover the time since the previous ``get_stats()`` call.

    Attributes:
      cpu_cache_usage_perc: Chunks not reclaimable now (allocated minus free minus
        evictable): write-pending plus pinned by loads, over ``num_chunks``.
      cpu_cache_write_usage_perc: Write-pending chunks (stores in flight) over
        ``num_chunks``.
      cpu_cache_read_usage_perc: ``max(usage - write_usage, 0)``: chunks pinned by loads.
      cpu_allocation_size: The size of each successful or failed allocation attempt of
        ``prepare_store`` (number of keys to store) since the last call, in call order.
        vLLM observes these into a histogram with ``ALLOCATION_SIZE_BUCKETS``.
      stores_skipped: Keys left unstored by the reuse threshold since the last call;
        None when ``store_threshold < 2`` (vLLM does not export the metric then).
    """

    cpu_cache_usage_perc: float
    cpu_cache_write_usage_perc: float
    cpu_cache_read_usage_perc: float
    cpu_allocation_size: tuple[int, ...]
    stores_skipped: int | None
