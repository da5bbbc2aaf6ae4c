"""`JaxOffloadingSpec`: vLLM 0.33.0's out-of-tree `OffloadingSpec` hook, built lazily.

vLLM loads it by configuration alone (`spec_name="JaxOffloadingSpec"`,
`spec_module_path="jax_kvoffload.bridge.vllm"`). `build_spec_classes()` imports vLLM
and defines the subclasses on first use, so `jax_kvoffload.bridge.vllm` imports without
vLLM or torch.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict, cast

from jax_kvoffload.bridge._vllm_pools import (
    canonical_worker_pool,
    group_missing,
    shared_direct_pool,
)
from jax_kvoffload.config import (
    ConfigFieldError,
    ConfigTypeError,
    HostTierConfig,
    OffloadingConfig,
    host_tier_config,
)

if TYPE_CHECKING:
    from typing import Self

    from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager
    from vllm.v1.kv_offload.base import OffloadingMetricMetadata as MetricMetadata
    from vllm.v1.kv_offload.config import OffloadingConfig as VllmOffloadingConfig

    from jax_kvoffload.hostmem import HostPool, SharedHostRegion
    from jax_kvoffload.stats import OffloadStats

__all__ = ["build_spec_classes", "our_offloading_config"]

logger = logging.getLogger(__name__)

# vLLM's extra config (`kv_connector_extra_config`) is a loose mapping of config values,
# hence the `Any`s of `dict[str, Any]` below, as vLLM types it.


class _TierRows(TypedDict):
    """The host rows' geometry the scheduler's tiers read (vLLM's layout)."""

    kv_bytes_per_chunk: int
    cpu_page_size_per_worker: int
    replicated: bool


class _PoolSizes(TypedDict):
    """A worker pool's size: chunks, blocks per chunk, bytes per block by tensor."""

    num_chunks: int
    blocks_per_chunk: int
    widths: dict[int, int]


def our_offloading_config(vllm_config: VllmOffloadingConfig) -> OffloadingConfig:
    """vLLM's `OffloadingConfig` converted into ours (the same fields, validated, but
    `kv_cache_layout`, which vLLM copies through unchecked).

    Ours is hashable (a jit static), yet its `extra_config` reads back as vLLM's: each
    read returns a fresh copy in the caller's types (lists stay lists, dicts dicts), so
    vLLM code handed our config (e.g. the tiering spec's `secondary_tiers` list check)
    works, and nothing it does to its copy changes ours (docs/config.md).
    """
    data = {f.name: getattr(vllm_config, f.name) for f in dataclasses.fields(vllm_config)}
    for name in ("model", "cache", "parallel"):
        data[name] = dataclasses.asdict(data[name])
    data["groups"] = [dataclasses.asdict(g) for g in data["groups"]]
    data["extra_config"] = dict(data["extra_config"])
    layout = data.pop("kv_cache_layout", None)  # copied as vLLM copies it, unchecked
    return OffloadingConfig.from_dict(data).with_layout_as_given(layout)


def read_host_tier(extra_config: Mapping[str, Any]) -> tuple[HostTierConfig, Exception | None]:
    """The host-tier keys, parsed once; an error in a key vLLM reads only when it builds
    the manager (`HostTierConfig.MANAGER_KEYS`) is returned, to be raised there."""
    try:
        return host_tier_config(extra_config), None
    except (ConfigFieldError, ConfigTypeError) as e:
        late = [f"kv_connector_extra_config[{k!r}]" for k in HostTierConfig.MANAGER_KEYS]
        if e.field not in late:
            raise
        early = {k: v for k, v in extra_config.items() if k not in HostTierConfig.MANAGER_KEYS}
        return host_tier_config(early), e


@functools.cache
def build_spec_classes() -> dict[str, type]:
    """Returns `{"JaxOffloadingSpec", "JaxOffloadingManager", "JaxOffloadingWorker"}`."""
    from vllm.v1.kv_offload import base
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from jax_kvoffload.assembly import build_store, host_capacity
    from jax_kvoffload.bridge._torch_worker import TorchKVWorker, host_widths
    from jax_kvoffload.bridge._vllm_manager import build_manager_class, install_vllm_types
    from jax_kvoffload.bridge._vllm_metrics import (
        declare_cpu_offloading,
        metric_definitions,
        our_definitions,
        spec_stats,
        tokens_per_chunk,
    )
    from jax_kvoffload.bridge._vllm_tiering import (
        tiered_canonical_rows,
        tiered_worker_pool,
        vllm_tier_dicts,
    )

    def _tiering_extra(extra_config: dict[str, Any]) -> dict[str, Any] | None:
        """The extra config with `secondary_tiers` in vLLM's shape, or None without."""
        if not extra_config.get("secondary_tiers"):
            return None
        host, _ = read_host_tier(extra_config)
        return {**extra_config, "secondary_tiers": vllm_tier_dicts(host)}

    manager_cls = build_manager_class()

    class JaxOffloadingWorker(TorchKVWorker, base.OffloadingWorker):
        """vLLM's `OffloadingWorker` over DLPack views of vLLM's KV tensors."""

        @classmethod
        def from_canonical(
            cls,
            kv_caches: CanonicalKVCaches,
            *,
            blocks_per_chunk: int,
            num_chunks: int,
            config: OffloadingConfig | None = None,
            rows: _TierRows | None = None,
        ) -> Self:
            """A worker over vLLM's `CanonicalKVCaches`, moving the bytes vLLM's
            `CPUOffloadingWorker` moves (each ref's unpadded page). With `config`:
            canonical pages when it sets `canonical_layout` (fails closed), else one host
            copy shared by the workers when it sets `replicated_layout` with several
            workers; private direct pages otherwise. With `rows` (the spec's, when it
            has secondary tiers) the chunk rows of the region the scheduler's tiers
            read and fill."""
            tensors = [(t.tensor, t.page_size_bytes) for t in kv_caches.tensors]
            refs = [
                [(r.tensor_idx, r.page_size_bytes) for r in group]
                for group in kv_caches.group_data_refs
            ]
            pool: HostPool | None = None
            region: SharedHostRegion | None = None
            sizes: _PoolSizes = {
                "num_chunks": num_chunks,
                "blocks_per_chunk": blocks_per_chunk,
                "widths": host_widths(refs),
            }
            if rows is not None and config is not None and config.canonical_layout:
                # Canonical pages in the rows the scheduler's tiers read (whole rows).
                shared = tiered_canonical_rows(config, rows["kv_bytes_per_chunk"])
                pool, region = canonical_worker_pool(kv_caches, config, **sizes, shared=shared)
            elif rows is not None and config is not None and num_chunks > 0:
                # Secondary tiers: the rows the scheduler's tiers read (vLLM's layout).
                pool, region = tiered_worker_pool(
                    config,
                    num_chunks=num_chunks,
                    blocks_per_chunk=blocks_per_chunk,
                    widths=sizes["widths"],
                    **rows,
                )
            elif config is not None and config.canonical_layout:
                pool, region = canonical_worker_pool(kv_caches, config, **sizes)
            elif (
                config is not None
                and config.replicated_layout
                and config.parallel.world_size > 1
                and num_chunks > 0  # nothing to share (vLLM maps no region either)
            ):
                pool, region = shared_direct_pool(config, **sizes)
            try:
                return cls(
                    tensors,
                    refs,
                    blocks_per_chunk=blocks_per_chunk,
                    num_chunks=num_chunks,
                    result_type=base.TransferResult,
                    pool=pool,
                    on_shutdown=None if region is None else region.close,
                    not_ready=(
                        None if region is None else functools.partial(group_missing, region)
                    ),
                )
            except BaseException:
                if region is not None:  # as vLLM's create_worker: no leaked region
                    region.close()
                raise

    class JaxOffloadingSpec(base.OffloadingSpec):
        """Host-memory offloading through jax_kvoffload (docs/vllm.md).

        Sizing, extra-config keys, metrics and config-info labels are those of vLLM's
        `CPUOffloadingSpec`; the manager is our `HostStore`, the worker moves bytes
        with our kernels over zero-copy views of vLLM's tensors.
        """

        @classmethod
        def build_metric_definitions(
            cls, extra_config: dict[str, Any]
        ) -> dict[str, MetricMetadata]:
            tiered = _tiering_extra(extra_config)
            if tiered is not None:  # vLLM's tiering metrics, each tier's, and our primary's
                return {
                    **TieringOffloadingSpec.build_metric_definitions(tiered),
                    **our_definitions(),
                }
            return metric_definitions(extra_config)  # vLLM's CPU-spec metrics, then ours

        @classmethod
        def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
            tiered = _tiering_extra(extra_config)
            if tiered is not None:
                return TieringOffloadingSpec.config_info_keys(tiered)
            return CPUOffloadingInfo.config_info_keys()

        def __init__(self, config: VllmOffloadingConfig) -> None:
            super().__init__(config)
            self.offloading_config = our_offloading_config(config)
            self.canonical_layout = self.offloading_config.canonical_layout
            parallel = self.offloading_config.parallel
            # vLLM's gate (CPUOffloadingSpec.__init__): keep one host copy of replicated
            # (MLA) pages only where the workers' host buffer is one shared region, since
            # a private buffer per rank would lose the pages non-writer ranks skip.
            self.replicated_layout = (
                self.offloading_config.replicated_layout and self._uses_shared_region()
            )
            self.host_tier, self._manager_error = read_host_tier(self.extra_config)
            self.tiered = bool(self.host_tier.secondary_tiers)
            capacity = host_capacity(
                self.host_tier,
                # vLLM sizes nothing without workers (world_size 0): no KV bytes then.
                worker_kv_bytes_per_block=(
                    self.offloading_config.worker_kv_bytes_per_block
                    if parallel.world_size > 0
                    else 0
                ),
                blocks_per_chunk=self.blocks_per_chunk,
                world_size=max(parallel.world_size, 1),
                replicated_layout=self.replicated_layout,
            )
            self.num_chunks = capacity.num_chunks
            self.kv_bytes_per_chunk = capacity.kv_bytes_per_chunk
            # Public in vLLM's CPU spec (its tiering spec sizes secondary-tier pages by it).

            self.cpu_page_size_per_worker = capacity.cpu_page_size_per_worker
            self.cpu_info = CPUOffloadingInfo.from_config(
                config, self.num_chunks, self.kv_bytes_per_chunk
            )
            self.eviction_policy: str = self.host_tier.eviction_policy
            self.cache_policy_module_path: str | None = self.host_tier.cache_policy_module_path

            # Our JaxOffloadingManager, or vLLM's TieringOffloadingManager over our primary
            # tier (its `primary_tier`): Any, classes made at run time.
            self._manager: Any = None
            self._worker: JaxOffloadingWorker | None = None

        def _uses_shared_region(self) -> bool:
            """Whether the workers' host buffer is one region they all map (vLLM's
            predicate of the same name). Always, for ours: with several workers the
            direct and canonical pools live in a `SharedHostRegion` on every platform
            (like vLLM's `TieringOffloadingSpec`, which answers True for the same
            reason); vLLM's CPU spec maps its region only on CUDA-alike and XPU hosts.
            The guard that replaces vLLM's platform test: a worker whose peers have not
            all mapped the region fails every job (`group_missing`), and a region that
            cannot be made fails `get_worker`; there is no private fallback that
            would silently drop the skipped stores (docs/vllm.md)."""
            return True

        def get_manager(self) -> OffloadingManager:
            if self._manager is None:
                if self._manager_error is not None:  # where vLLM reads the key
                    raise self._manager_error
                install_vllm_types()  # vLLM-registered policy names resolve too
                store = build_store(
                    self.host_tier,
                    self.num_chunks,
                    enable_events=bool(self.kv_events_config.enable_kv_cache_events),
                )
                if self.tiered:
                    from jax_kvoffload.bridge._vllm_tiering import build_tiering_manager

                    self._manager = build_tiering_manager(self, store)
                else:
                    tokens = tokens_per_chunk(self.offloading_config)
                    self._manager = manager_cls(store, self.cpu_info.as_config_info(), tokens)
            return cast("OffloadingManager", self._manager)

        def stats(self) -> OffloadStats:
            """This instance's `OffloadStats` (docs/observability.md): the store side
            if it built the manager, the transfer totals if it built the worker."""
            # With tiers the manager is vLLM's TieringOffloadingManager: the store side
            # is its primary tier's (our manager over the same HostStore).
            manager = self._manager
            if manager is not None and self.tiered:
                manager = manager.primary_tier
            return spec_stats(manager, self._worker, self.offloading_config, self.num_chunks)

        def get_worker(self, kv_caches: CanonicalKVCaches) -> JaxOffloadingWorker:
            if self._worker is None:
                self._worker = JaxOffloadingWorker.from_canonical(
                    kv_caches,
                    blocks_per_chunk=self.blocks_per_chunk,
                    num_chunks=self.num_chunks,
                    config=self.offloading_config,
                    rows=self._tier_rows() if self.tiered else None,
                )
            return self._worker

        def _tier_rows(self) -> _TierRows:
            """The host rows' geometry the scheduler's tiers read (vLLM's layout)."""
            return {
                "kv_bytes_per_chunk": self.kv_bytes_per_chunk,
                "cpu_page_size_per_worker": self.cpu_page_size_per_worker,
                "replicated": self.replicated_layout,
            }

    declare_cpu_offloading(JaxOffloadingSpec)

    return {
        "JaxOffloadingSpec": JaxOffloadingSpec,
        "JaxOffloadingManager": manager_cls,
        "JaxOffloadingWorker": JaxOffloadingWorker,
    }
