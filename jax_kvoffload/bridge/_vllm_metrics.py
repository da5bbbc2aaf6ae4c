"""The plug-in's metrics: vLLM 0.33.0's CPU-tier metrics plus ours, and its snapshot.

vLLM builds one Prometheus metric per name its spec's `build_metric_definitions`
declares (`OffloadPromMetrics`), and every name a manager's `get_stats()` payload
carries must be declared there. `JaxOffloadingSpec` declares vLLM's CPU-spec names
(same names, types, buckets and labels, so dashboards for vLLM's CPU offloading work
unchanged) and the names below, which its manager adds to each payload. Transfer bytes
and times (`vllm:kv_offload_{store,load}_{bytes,time,size}`) need nothing from us:
vLLM's connector reads them from our worker's `TransferResult`s.

Ours say what vLLM's gauges do not: how full the host tier is (vLLM's
`cpu_cache_usage_perc` counts only chunks pinned by transfers), and how lookups,
stores and evictions went. Counters are sent as increments since the previous
`get_stats()` (vLLM sums them), from the store's cumulative counters.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

from jax_kvoffload.config import OffloadingConfig
from jax_kvoffload.stats import OffloadStats

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import OffloadingMetricMetadata

    from jax_kvoffload.stats import TransferTotals
    from jax_kvoffload.store import StoreStats

__all__ = [
    "CHUNK_EVICTIONS",
    "CHUNK_LOOKUPS",
    "CHUNK_STORES",
    "OCCUPANCY_PERC",
    "CounterDeltas",
    "declare_cpu_offloading",
    "metric_definitions",
    "our_definitions",
    "spec_stats",
    "tokens_per_chunk",
]

OCCUPANCY_PERC = "vllm:kv_offload_jax_occupancy_perc"
CHUNK_LOOKUPS = "vllm:kv_offload_jax_chunk_lookups"  # label result: hit, hit_pending, miss
CHUNK_STORES = "vllm:kv_offload_jax_chunk_stores"  # label result: completed, failed
CHUNK_EVICTIONS = "vllm:kv_offload_jax_chunk_evictions"

# (metric, label value or None, StoreCounters field)
_COUNTERS = (
    (CHUNK_LOOKUPS, "hit", "lookup_hits"),
    (CHUNK_LOOKUPS, "hit_pending", "lookup_hits_pending"),
    (CHUNK_LOOKUPS, "miss", "lookup_misses"),
    (CHUNK_STORES, "completed", "stores_completed"),
    (CHUNK_STORES, "failed", "stores_failed"),
    (CHUNK_EVICTIONS, None, "evictions"),
)


def metric_definitions(extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
    """vLLM's `CPUOffloadingSpec.build_metric_definitions(extra_config)` plus ours."""
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    return {**CPUOffloadingSpec.build_metric_definitions(extra_config), **our_definitions()}


def our_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The names our manager adds to every payload (`CounterDeltas`): declared by the
    spec with or without tiers (with tiers, our store is the primary tier of vLLM's
    tiering manager, whose payload carries the primary's)."""
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata

    return {
        OCCUPANCY_PERC: OffloadingGaugeMetadata(
            documentation=(
                "Fraction of the CPU KV-cache chunks holding a chunk now (readable, "
                "pinned by loads or being stored); 1.0 = full. Unlike "
                "vllm:kv_offload_cpu_cache_usage_perc, idle stored chunks count."
            ),
        ),
        CHUNK_LOOKUPS: OffloadingCounterMetadata(
            documentation=(
                "KV offload chunk lookups by result: hit (stored, readable), "
                "hit_pending (its store in flight), miss."
            ),
            labelnames=("result",),
        ),
        CHUNK_STORES: OffloadingCounterMetadata(
            documentation=(
                "KV offload chunk stores by result: completed (now readable) or "
                "failed (freed, never readable)."
            ),
            labelnames=("result",),
        ),
        CHUNK_EVICTIONS: OffloadingCounterMetadata(
            documentation="CPU KV-cache chunks evicted to make room for new stores.",
        ),
    }


def declare_cpu_offloading(spec_cls: type) -> None:
    """Makes `spec_cls` a virtual subclass of vLLM's `CPUOffloadingSpec`.

    vLLM's `OffloadPromMetrics` feeds its deprecated per-direction transfer series
    (`vllm:kv_offload_total_bytes`, `_total_time`, `_size`, label `transfer_type`
    `CPU_to_GPU` / `GPU_to_CPU`) only when `issubclass(spec_cls, CPUOffloadingSpec)`;
    for any other spec they stay at zero. Ours offloads to CPU memory as that spec
    does (same metric names, sizing and config-info labels), so dashboards built on
    those series must keep working. That check is vLLM 0.33.0's only
    `isinstance`/`issubclass` use of the class (its tiering spec subclasses it).
    """
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    CPUOffloadingSpec.register(spec_cls)


class CounterDeltas:
    """Adds our metrics to a manager's `OffloadingConnectorStats` payload.

    Called from the scheduler thread (vLLM's `get_stats`), once per payload.
    """

    def __init__(self) -> None:
        self._sent: dict[str, int] = {}

    def report(self, payload: OffloadingConnectorStats, store_stats: StoreStats) -> None:
        """Adds the occupancy gauge and the counter increments since the last call
        (`store_stats`: the `StoreStats` the same `get_stats` produced)."""
        payload.set_gauge(OCCUPANCY_PERC, store_stats.occupancy_perc)
        counters = store_stats.counters
        for name, label, field in _COUNTERS:
            now = getattr(counters, field)
            delta = now - self._sent.get(field, 0)
            if delta:
                payload.increase_counter(name, delta, () if label is None else (label,))
                self._sent[field] = now


def tokens_per_chunk(config: OffloadingConfig) -> int | None:
    """Tokens one chunk spans, or None where the groups differ (the manager sees keys,
    not which group each is of)."""
    tokens = {g.tokens_per_block for g in config.groups}
    return config.cache.blocks_per_chunk * tokens.pop() if len(tokens) == 1 else None


class StoreSide(Protocol):
    """What `spec_stats` asks of a manager (`JaxOffloadingManager`)."""

    def offload_stats(self) -> OffloadStats: ...


class TransferSide(Protocol):
    """What `spec_stats` asks of a worker (`TorchKVWorker`)."""

    def transfer_totals(self) -> tuple[TransferTotals, TransferTotals]: ...


def spec_stats(
    manager: StoreSide | None,
    worker: TransferSide | None,
    config: OffloadingConfig,
    num_chunks: int,
) -> OffloadStats:
    """A spec instance's `OffloadStats`: the store side from its manager (if it built
    one), the transfer totals from its worker (if it built one)."""
    if manager is not None:
        stats = manager.offload_stats()
    else:
        tokens = None if tokens_per_chunk(config) is None else 0
        stats = OffloadStats(num_chunks=num_chunks, hit_tokens=tokens)
    if worker is not None:
        store, load = worker.transfer_totals()
        stats = dataclasses.replace(stats, store=store, load=load)
    return stats
