"""Our `HostStore` behind vLLM 0.33.0's `OffloadingManager` interface
(`vllm/v1/kv_offload/base.py`).

Built on first use by `build_manager_class()`, which imports vLLM; importing this module
does not. The adapter translates types only; every decision (allocation, eviction,
pins, events, stats) is the host store's, which follows `CPUOffloadingManager`.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterator
from typing import Any

from jax_kvoffload.store import HostStore, RequestContext

__all__ = ["build_manager_class"]


def _our_context(req_context: Any, keys: Collection[bytes] = ()) -> RequestContext:
    """Our context for a vLLM `ReqContext`, kept in its per-type scratch state.

    vLLM's scheduler records each key's end position on its own context; they are
    copied over for the keys of the call, so the eviction policy ranks them the same."""
    ours = req_context.get_state(RequestContext)
    if ours is None:
        ours = RequestContext(str(req_context.req_id))
        req_context.set_state(ours)
    for key in keys:
        position = req_context.get_offload_key_position(key)
        if position is not None:
            ours.set_key_position(bytes(key), position)
    return ours


@functools.cache
def build_manager_class() -> type:
    """Returns `JaxOffloadingManager`, a subclass of vLLM's `OffloadingManager`."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload import base
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    class JaxOffloadingManager(base.OffloadingManager):
        """vLLM's manager protocol over a `HostStore` (one scheduler thread, so the
        default no-op `lock`).

        Args:
          store: the host store; `num_chunks` sized as vLLM's CPU spec does.
          config_info: the labels of `vllm:kv_offload_config_info` (CPU tier facts).
        """

        def __init__(self, store: HostStore, config_info: Any = None) -> None:
            self.store = store
            self._config_info = dict(config_info or {})

        def lookup(self, key: Any, req_context: Any) -> Any:
            result = self.store.lookup(key, _our_context(req_context))
            return base.LookupResult[result.name]

        def get_load_source(self, key: Any, req_context: Any) -> Any:
            return CacheHitSource.HOST

        def prepare_load(self, keys: Collection[Any], req_context: Any) -> Any:
            keys = list(keys)
            return CPULoadStoreSpec(
                list(self.store.prepare_load(keys, _our_context(req_context, keys)))
            )

        def touch(self, keys: Collection[Any], req_context: Any) -> None:
            keys = list(keys)
            self.store.touch(keys, _our_context(req_context, keys))

        def complete_load(self, keys: Collection[Any], req_context: Any) -> None:
            keys = list(keys)
            self.store.complete_load(keys, _our_context(req_context, keys))

        def prepare_store(self, keys: Collection[Any], req_context: Any) -> Any:
            keys = list(keys)
            out = self.store.prepare_store(keys, _our_context(req_context, keys))
            if out is None:
                return None
            return base.PrepareStoreOutput(
                keys_to_store=list(out.keys_to_store),
                store_spec=CPULoadStoreSpec(list(out.chunk_ids)),
                evicted_keys=list(out.evicted_keys),
            )

        def complete_store(
            self, keys: Collection[Any], req_context: Any, success: bool = True
        ) -> None:
            keys = list(keys)
            self.store.complete_store(keys, success, _our_context(req_context, keys))

        def on_new_request(self, req_context: Any) -> Any:
            self.store.on_new_request(_our_context(req_context))
            return base.RequestOffloadingContext()

        def on_request_finished(self, req_context: Any) -> None:
            self.store.on_request_finished(_our_context(req_context))

        def take_events(self) -> Iterator[Any]:
            for event in self.store.take_events():
                yield base.OffloadingEvent(
                    keys=list(event.keys),
                    medium=base.Medium[event.medium.name],
                    removed=event.removed,
                    metadata_only=event.metadata_only,
                )

        def reset_cache(self) -> None:
            self.store.reset_cache()

        def get_stats(self) -> Any:
            s = self.store.get_stats()
            stats = OffloadingConnectorStats()
            stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, s.cpu_cache_usage_perc)
            for size in s.cpu_allocation_size:
                stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
            stats.set_gauge(
                CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, s.cpu_cache_write_usage_perc
            )
            stats.set_gauge(
                CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, s.cpu_cache_read_usage_perc
            )
            if s.stores_skipped is not None:
                stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, s.stores_skipped)
            return stats

        def config_info(self) -> list[Any]:
            return [self._config_info]

    return JaxOffloadingManager
