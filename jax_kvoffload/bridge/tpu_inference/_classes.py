"""The connector classes, built on first use (they subclass vLLM's and tpu-inference's).

- `JaxStoreScheduler(TPUOffloadConnectorScheduler)`: their scheduler, unchanged but for
  its `offload_manager`, which is our `StoreManager` over the engine's `HostStore`.
- `TPUOffloadConnector(KVConnectorBase_V1)`: the class vLLM-TPU loads by name from
  `kv_connector_module_path="jax_kvoffload.bridge.tpu_inference"`; it keeps their
  connector's surface (the `KVConnectorBase_V1` methods, `register_runner`, their
  metadata and stats types, their layout answer) and delegates to their scheduler or to
  our `StoreWorker`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

from jax_kvoffload.bridge.tpu_inference._errors import TPUConnectorConfigError
from jax_kvoffload.bridge.tpu_inference._hub import Hub, hub_for
from jax_kvoffload.bridge.tpu_inference._manager import StoreManager
from jax_kvoffload.bridge.tpu_inference._worker import StoreWorker
from jax_kvoffload.config import host_tier_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
    )
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.kv_offload.base import OffloadingEvent
    from vllm.v1.kv_offload.base import OffloadKey as VllmOffloadKey
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from jax_kvoffload.store import OffloadKey

__all__ = ["build_classes"]


def _new_hub(vllm_config: VllmConfig) -> Hub:
    from tpu_inference import envs

    extra = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", {}) or {})
    if extra.get("cpu_bytes_to_use") is not None:
        raise TPUConnectorConfigError(
            "kv_connector_extra_config['cpu_bytes_to_use']",
            extra["cpu_bytes_to_use"],
            "the host chunks are counted by TPU_OFFLOAD_NUM_CPU_CHUNKS (tpu-inference's "
            "variable, which their scheduler's staging also reads); drop the key",
        )
    return Hub(host=host_tier_config(extra), num_chunks=int(envs.TPU_OFFLOAD_NUM_CPU_CHUNKS))


def _check_parallel(vllm_config: VllmConfig) -> None:
    parallel = vllm_config.parallel_config
    for name in ("pipeline_parallel_size", "data_parallel_size"):
        value = getattr(parallel, name, 1)
        if value > 1:
            raise TPUConnectorConfigError(
                f"parallel_config.{name}",
                value,
                "tpu-inference's offload scheduler serves one pipeline stage and one data-"
                "parallel rank; run without it",
            )
    if os.environ.get("TPU_MULTIHOST_BACKEND"):
        raise TPUConnectorConfigError(
            "TPU_MULTIHOST_BACKEND",
            os.environ["TPU_MULTIHOST_BACKEND"],
            "multi-host engines keep a worker process per host, away from the scheduler's "
            "store; this connector serves single-host engines (unset it)",
        )


def _vllm_event(
    keys: tuple[OffloadKey, ...], removed: bool, metadata_only: bool
) -> OffloadingEvent:
    from vllm.v1.kv_offload import base

    # Ours and vLLM's OffloadKey are NewTypes over the same bytes.
    vllm_keys = cast("list[VllmOffloadKey]", list(keys))
    return base.OffloadingEvent(vllm_keys, base.Medium.CPU, removed, metadata_only=metadata_only)


def _events_tracker(vllm_config: VllmConfig) -> OffloadingEventsTracker | None:
    """vLLM's event translator, or None where KV events are off (nothing is recorded)."""
    events = getattr(vllm_config, "kv_events_config", None)
    if not getattr(events, "enable_kv_cache_events", False):
        return None
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
        OffloadingEventsTracker,
    )
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig

    return OffloadingEventsTracker(OffloadingKVEventsConfig(True, False))


@functools.cache
def build_classes() -> dict[str, type]:
    """Returns `{"TPUOffloadConnector", "JaxStoreScheduler"}` (imports vLLM and
    tpu-inference)."""
    from tpu_inference.offload import tpu_offload_connector as theirs
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
    )

    class JaxStoreScheduler(theirs.TPUOffloadConnectorScheduler):
        """Their scheduler over our store (`StoreManager`); nothing else changes."""

        def __init__(self, vllm_config: VllmConfig, hub: Hub) -> None:
            super().__init__(vllm_config)
            if hub.store is None:
                from jax_kvoffload.assembly import build_store

                events = getattr(vllm_config, "kv_events_config", None)
                hub.store = build_store(
                    hub.host,
                    hub.num_chunks,
                    enable_events=bool(getattr(events, "enable_kv_cache_events", False)),
                )
            self.offload_manager = StoreManager(hub)
            self.hub = hub

    class TPUOffloadConnector(KVConnectorBase_V1):
        """tpu-inference's offload connector with jax_kvoffload's store, kernels and
        tiers behind it (docs/tpu_inference.md)."""

        def __init__(
            self,
            vllm_config: VllmConfig,
            role: KVConnectorRole,
            kv_cache_config: KVCacheConfig | None = None,
        ) -> None:
            # vLLM's base keeps kv_cache_config as given (None: a caller that has none).
            super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
            _check_parallel(vllm_config)
            hub = hub_for(vllm_config, lambda: _new_hub(vllm_config))
            self.hub = hub
            self._events = _events_tracker(vllm_config)
            # One side per role (JaxStoreScheduler, StoreWorker), the other None: Any, as
            # vLLM calls a side's methods on its role only (theirs hold the same).
            self.connector_scheduler: Any = None
            self.connector_worker: Any = None
            if role == KVConnectorRole.SCHEDULER:
                self.connector_scheduler = JaxStoreScheduler(vllm_config, hub)
            elif role == KVConnectorRole.WORKER:
                self.connector_worker = StoreWorker(
                    hub,
                    self,
                    theirs.KVOffloadConnectorStats(),
                    model=str(vllm_config.model_config.model),
                    block_size=int(vllm_config.cache_config.block_size),
                )

        @classmethod
        def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
            return theirs.TPUOffloadConnector.get_required_kvcache_layout(vllm_config)

        @classmethod
        def build_kv_connector_stats(
            cls,
            data: dict[str, Any] | None = None,  # vLLM's type: a stats payload
        ) -> KVConnectorStats | None:
            return theirs.TPUOffloadConnector.build_kv_connector_stats(data)

        # -- scheduler side ---------------------------------------------------------------

        def get_num_new_matched_tokens(
            self, request: Request, num_computed_tokens: int
        ) -> tuple[int | None, bool]:
            return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

        def update_state_after_alloc(
            self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
        ) -> None:
            self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

        def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
            return self.connector_scheduler.build_connector_meta(scheduler_output)

        def request_finished(
            self, request: Request, block_ids: list[int]
        ) -> tuple[bool, dict[str, Any] | None]:  # vLLM's type: the KV transfer params
            return self.connector_scheduler.request_finished(request, block_ids)

        def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
            self.connector_scheduler.update_connector_output(connector_output)

        def flush_tiers(self, timeout: float | None = None) -> bool:
            """Waits until every cascade and promotion in flight reached its tier (e.g.
            before the process exits); False on timeout, True at once without tiers."""
            path = self.hub.tier_path()
            return True if path is None else path.wait(timeout=timeout)

        def take_events(self) -> Iterator[KVCacheEvent]:
            """The store's events as vLLM's KV cache events (`BlockStored`,
            `BlockRemoved`), translated by vLLM's own `OffloadingEventsTracker` with
            its legacy payload (block hash and group; no tokens), as vLLM's offloading
            connector emits them without self-describing events. Empty unless
            `kv_events_config.enable_kv_cache_events`."""
            store = self.hub.store
            if store is None or self._events is None:
                return
            yield from self._events.take_events(store.take_events(_vllm_event))

        # -- worker side ------------------------------------------------------------------

        def register_kv_caches(self, kv_caches: object) -> None:
            """A no-op, as theirs: the runner reassigns its caches every step, so the
            worker reads `runner.kv_caches` at each operation (`register_runner`)."""

        def register_runner(self, runner: Any) -> None:  # StoreWorker.register_runner's
            self.connector_worker.register_runner(runner)

        def start_load_kv(self, fwd_ctx: object, **kwargs: Any) -> None:  # type: ignore[override]
            self.connector_worker.start_load_kv()

        def wait_for_layer_load(self, layer_name: str) -> None:
            """Loads are whole before the forward (no layer-wise load, as theirs)."""

        def save_kv_layer(
            self, layer_name: str, kv_layer: object, attn_metadata: object, **kwargs: Any
        ) -> None:
            """Saves are whole after the forward (no layer-wise save, as theirs)."""

        def wait_for_save(self) -> None:
            self.connector_worker.start_save_kv()

        def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
            return self.connector_worker.get_finished()

        def get_kv_connector_stats(self) -> KVConnectorStats | None:
            if self.connector_worker is None:
                return None
            return self.connector_worker.get_kv_connector_stats()

    TPUOffloadConnector.__module__ = "jax_kvoffload.bridge.tpu_inference"
    JaxStoreScheduler.__module__ = "jax_kvoffload.bridge.tpu_inference"
    return {"TPUOffloadConnector": TPUOffloadConnector, "JaxStoreScheduler": JaxStoreScheduler}
