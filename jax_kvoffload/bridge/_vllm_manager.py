"""Our `HostStore` behind vLLM 0.33.0's `OffloadingManager` interface
(`vllm/v1/kv_offload/base.py`).

Built on first use by `build_manager_class()`, which imports vLLM; importing this module
does not. The adapter translates types only; every decision (allocation, eviction,
pins, events, stats) is the host store's, which follows `CPUOffloadingManager` call for
call (tests/bridge/test_vllm_manager_diff.py checks that on random traces).

vLLM's own `ReqContext` is handed to the store and its policies unchanged: it has the
methods the store reads (`get_offload_key_position`, `get_state`, `set_state`), so
positions the scheduler records later are seen, and nothing is copied per call.
`install_vllm_types()` makes that explicit (vLLM's `ReqContext` becomes a virtual
subclass of our `AbstractRequestContext`, its `CachePolicy` one of our
`AbstractEvictionPolicy`, and our LRU/ARC policies virtual subclasses of vLLM's
`CachePolicy`) and lets the store resolve policy names registered with vLLM's
`CachePolicyFactory`.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING

from jax_kvoffload.bridge._vllm_metrics import CounterDeltas
from jax_kvoffload.stats import OffloadStats, store_side
from jax_kvoffload.store import (
    AbstractEvictionPolicy,
    AbstractRequestContext,
    ARCPolicy,
    HostStore,
    LRUPolicy,
    add_policy_resolver,
)
from jax_kvoffload.store.internals import register_plain_context

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats as ConnectorStats,
    )
    from vllm.v1.kv_offload.base import (
        ConfigInfoMapping,
        LoadStoreSpec,
        LookupResult,
        OffloadingEvent,
        OffloadKey,
        PrepareStoreOutput,
        ReqContext,
        RequestOffloadingContext,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource as HitSource

    from jax_kvoffload.store import OffloadKey as OurOffloadKey

__all__ = ["build_manager_class", "install_vllm_types"]


def _vllm_policy(name: str) -> type | None:
    """A policy registered with vLLM's `CachePolicyFactory`, or None."""
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    # vLLM's factory raises ValueError for a name it does not know (without a module
    # path); module paths are resolved by our registry, as vLLM resolves them.
    try:
        return CachePolicyFactory.get_cache_policy_cls(name, None)
    except ValueError:
        return None


def _positions_are_plain(req_context_cls: type) -> bool:
    """Whether vLLM's `ReqContext` keeps positions in `_offload_key_positions` and
    `get_offload_key_position` reads that dict (true of 0.33.0; checked on a probe, so
    another version falls back to calling the method)."""
    probe = req_context_cls(req_id="probe")
    positions = getattr(probe, "_offload_key_positions", None)
    if type(positions) is not dict:
        return False
    probe.set_offload_key_position(b"key0", 16)
    positions[b"key1"] = 32
    return (
        positions == {b"key0": 16, b"key1": 32}
        and probe.get_offload_key_position(b"key1") == 32
        and probe.get_offload_key_position(b"key2") is None
    )


@functools.cache
def install_vllm_types() -> None:
    """Lets the store accept vLLM's request contexts and vLLM-style policies, and
    vLLM's managers host our policies.

    Our `LRUPolicy` and `ARCPolicy` implement vLLM's `CachePolicy` interface method
    for method (vLLM's `ReqContext` and `ChunkStatus` in, the same decisions out:
    tests/bridge/test_vllm_hosts_our_policies.py), so they become virtual subclasses
    of it: vLLM's `CachePolicyFactory` asserts `issubclass(cls, CachePolicy)` before
    it loads a policy by `cache_policy_module_path`.
    """
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.policies.base import CachePolicy

    AbstractRequestContext.register(ReqContext)
    if _positions_are_plain(ReqContext):
        register_plain_context(ReqContext, "_offload_key_positions")
    AbstractEvictionPolicy.register(CachePolicy)
    CachePolicy.register(LRUPolicy)
    CachePolicy.register(ARCPolicy)
    add_policy_resolver(_vllm_policy)


@functools.cache
def build_manager_class() -> type:
    """Returns `JaxOffloadingManager`, a subclass of vLLM's `OffloadingManager`."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload import base
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    install_vllm_types()
    hit, miss, hit_pending = (
        base.LookupResult.HIT,
        base.LookupResult.MISS,
        base.LookupResult.HIT_PENDING,
    )
    host = CacheHitSource.HOST
    cpu = base.Medium.CPU
    output_cls, event_cls = base.PrepareStoreOutput, base.OffloadingEvent

    def make_event(
        keys: tuple[OurOffloadKey, ...], removed: bool, metadata_only: bool
    ) -> OffloadingEvent:
        # The store builds vLLM's events directly when they are taken (no second copy).
        return event_cls(list(keys), cpu, removed, metadata_only=metadata_only)

    usage, write_usage, read_usage, alloc_size, skipped = (
        CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC,
        CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC,
        CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC,
        CPUOffloadingMetrics.CPU_ALLOCATION_SIZE,
        CPUOffloadingMetrics.STORES_SKIPPED,
    )

    class JaxOffloadingManager(base.OffloadingManager):
        """vLLM's manager protocol over a `HostStore` (one scheduler thread, so the
        default no-op `lock`).

        Args:
          store: the host store; `num_chunks` sized as vLLM's CPU spec does.
          config_info: the labels of `vllm:kv_offload_config_info` (CPU tier facts).
          tokens_per_chunk: tokens one chunk spans, for `offload_stats().hit_tokens`
            (None: the groups differ, hit tokens are not reported).
        """

        def __init__(
            self,
            store: HostStore,
            config_info: ConfigInfoMapping | None = None,
            tokens_per_chunk: int | None = None,
        ) -> None:
            self.store = store
            # Public in vLLM's CPUOffloadingManager (its events carry it; vLLM's tiers
            # expose the same attribute).
            self.medium = cpu
            self._config_info = dict(config_info or {})
            self._tokens_per_chunk = tokens_per_chunk
            self._deltas = CounterDeltas()
            # The scheduler calls lookup for every chunk of every request: the store's
            # own closure, answering vLLM's enum members (one Python frame).
            self.lookup = store.lookup_function(miss, hit, hit_pending)
            self._prepare_load = store.prepare_load
            self._prepare_store = store.prepare_store
            # Same signature and answer as vLLM's: the store's methods themselves.
            self.touch = store.touch
            self.complete_load = store.complete_load
            self.on_request_finished = store.on_request_finished
            self.reset_cache = store.reset_cache

        # replaced per instance
        def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
            return self.store.lookup_function(miss, hit, hit_pending)(key, req_context)

        def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> HitSource:
            return host

        def prepare_load(
            self, keys: Collection[OffloadKey], req_context: ReqContext
        ) -> LoadStoreSpec:
            return CPULoadStoreSpec(self._prepare_load(keys, req_context))

        # replaced per instance
        def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
            self.store.touch(keys, req_context)

        def complete_load(
            self, keys: Collection[OffloadKey], req_context: ReqContext
        ) -> None:  # replaced per instance
            self.store.complete_load(keys, req_context)

        def prepare_store(
            self, keys: Collection[OffloadKey], req_context: ReqContext
        ) -> PrepareStoreOutput | None:
            out = self._prepare_store(keys, req_context)
            if out is None:
                return None
            return output_cls(
                list(out.keys_to_store),
                CPULoadStoreSpec(out.chunk_ids),
                list(out.evicted_keys),
            )

        def complete_store(
            self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
        ) -> None:
            self.store.complete_store(keys, success, req_context)

        def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
            self.store.on_new_request(req_context)
            return base.RequestOffloadingContext()

        def on_request_finished(self, req_context: ReqContext) -> None:  # replaced per instance
            self.store.on_request_finished(req_context)

        def take_events(self) -> Iterator[OffloadingEvent]:
            # A generator, as vLLM's: the events are detached at the first next().
            yield from self.store.take_events(make_event)

        def reset_cache(self) -> None:  # replaced per instance
            self.store.reset_cache()

        def get_stats(self) -> ConnectorStats:
            s = self.store.get_stats()
            stats = OffloadingConnectorStats()
            stats.set_gauge(usage, s.cpu_cache_usage_perc)
            for size in s.cpu_allocation_size:
                stats.observe_histogram(alloc_size, size)
            stats.set_gauge(write_usage, s.cpu_cache_write_usage_perc)
            stats.set_gauge(read_usage, s.cpu_cache_read_usage_perc)
            if s.stores_skipped is not None:
                stats.increase_counter(skipped, s.stores_skipped)
            self._deltas.report(stats, s)  # ours: occupancy, lookups, stores, evictions
            return stats

        def offload_stats(self) -> OffloadStats:
            """The store side of the plug-in's `OffloadStats` (docs/observability.md);
            drains nothing, so vLLM's `get_stats` payloads are unaffected."""
            tpc = self._tokens_per_chunk
            hits = self.store.counters().lookup_hits
            return OffloadStats(**store_side(self.store, None if tpc is None else hits * tpc))

        def config_info(self) -> list[ConfigInfoMapping]:
            return [self._config_info]

    return JaxOffloadingManager
