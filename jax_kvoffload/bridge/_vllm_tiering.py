"""`JaxOffloadingSpec` with `secondary_tiers`: vLLM's own tiering manager over our store.

vLLM 0.33.0's `TieringOffloadingManager` (`vllm/v1/kv_offload/tiering/manager.py`)
orchestrates a primary (CPU) tier and secondary tiers: stores cascade device -> host ->
every tier, a tier hit is promoted tier -> host -> device, lookups may answer RETRY
while a tier looks, stores are dropped under backpressure. Rather than re-implement it,
the spec hands it our `HostStore` as the primary tier (`JaxPrimaryTier`: vLLM's
`CPUPrimaryTierOffloadingManager` interface, `prepare_read` pinning without recording
an access) and the tiers vLLM's own factory builds from the same `secondary_tiers` list:
ours (every kind of the tier registry, as its out-of-tree class: `"disk"` as
`JaxDiskTier`, ...) and vLLM's (`fs`, `obj`, `p2p`, ...). Every decision about tiers
is vLLM's; every decision about host chunks is the store's, which matches vLLM's CPU
manager id for id.

The secondary tiers read and write the primary rows from the scheduler process, so the
rows live in a `SharedHostRegion` that the scheduler and every worker map, laid out as
vLLM's `SharedOffloadRegion`: chunk c is row c of `kv_bytes_per_chunk` bytes, worker r's
bytes at `r * cpu_page_size_per_worker` of it (`ChunkRowPool` on the workers).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from jax_kvoffload.bridge._vllm_pools import region_name
from jax_kvoffload.config import ConfigFieldError, HostTierConfig, OffloadingConfig
from jax_kvoffload.hostmem import HostPool, SharedHostRegion, SharedRows, build_host_pool

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import ConfigInfoMapping
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

    from jax_kvoffload.store import HostStore, OffloadKey

__all__ = [
    "build_primary_class",
    "build_tiering_manager",
    "tiered_canonical_rows",
    "tiered_worker_pool",
    "vllm_tier_dicts",
]

logger = logging.getLogger(__name__)

_SUFFIX = "_tiers"


def vllm_tier_dicts(host: HostTierConfig) -> list[dict[str, Any]]:  # vLLM's loose entries
    """`secondary_tiers` as vLLM's factory takes them: ours as out-of-tree classes, vLLM's
    verbatim; each tier's `backpressure` merged over the top-level default field by
    field, as `TieringOffloadingSpec.__init__` does."""
    defaults = dict(host.backpressure or {})
    out = []
    for tier in host.secondary_tiers:
        entry = tier.to_vllm_dict()
        own = entry.get("backpressure")
        merged = {**defaults, **(own or {})}
        if merged or "backpressure" in entry:
            entry["backpressure"] = merged
        out.append(entry)
    return out


def _rows(
    config: OffloadingConfig, kv_bytes_per_chunk: int, slot: int, area_offset: int = 0
) -> SharedRows:
    """The rows' region, joined as `slot` of `world_size + 1` (the scheduler is the last):
    chunk c is row c of `kv_bytes_per_chunk` bytes (vLLM's `SharedOffloadRegion`)."""
    world = max(config.parallel.world_size, 1)
    name = region_name(config.engine_id) + _SUFFIX
    return SharedRows(name, world + 1, slot, row_stride=kv_bytes_per_chunk, area_offset=area_offset)


def _region(
    config: OffloadingConfig, num_chunks: int, kv_bytes_per_chunk: int, slot: int
) -> SharedHostRegion:
    """The scheduler's mapping of the rows (its tiers read and fill whole rows)."""
    rows = _rows(config, kv_bytes_per_chunk, slot)
    return SharedHostRegion(rows.name, num_chunks * kv_bytes_per_chunk, rows.attachments, rank=slot)


def tiered_worker_pool(
    config: OffloadingConfig,
    *,
    num_chunks: int,
    blocks_per_chunk: int,
    widths: dict[int, int],
    kv_bytes_per_chunk: int,
    cpu_page_size_per_worker: int,
    replicated: bool,
) -> tuple[HostPool, SharedHostRegion | None]:
    """This worker's `ChunkRowPool` over the rows the scheduler's tiers read, and the
    region (closed with the worker)."""
    rank = config.parallel.rank
    area = 0 if replicated else rank * cpu_page_size_per_worker
    need = blocks_per_chunk * sum(widths.values())
    if need > cpu_page_size_per_worker:
        raise ConfigFieldError(
            "worker_kv_bytes_per_block",
            f"the worker moves {need} bytes per chunk but its area of a host row is "
            f"{cpu_page_size_per_worker} bytes ({config.worker_kv_bytes_per_block} per "
            "block x blocks_per_chunk): the KV cache description does not match the tensors",
        )
    shared = _rows(config, kv_bytes_per_chunk, slot=rank, area_offset=area)
    return build_host_pool(num_chunks, widths, blocks_per_chunk, shared=shared)


def tiered_canonical_rows(config: OffloadingConfig, kv_bytes_per_chunk: int) -> SharedRows:
    """The rows the scheduler's tiers read, for a worker of canonical pages: every rank
    maps the whole row (its canonical pages start at offset 0, as in vLLM's
    `SharedOffloadRegion.create_next_canonical_view`; the ranks write disjoint bytes of
    them), so a row holds one chunk's canonical pages, whatever the TP size."""
    return _rows(config, kv_bytes_per_chunk, slot=config.parallel.rank)


@functools.cache
def build_primary_class() -> type:
    """`JaxPrimaryTier`: our manager with vLLM's primary-tier interface."""
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from jax_kvoffload.bridge._vllm_manager import build_manager_class

    class JaxPrimaryTier(build_manager_class()):  # type: ignore[misc]  # a class made at run time
        """Our `HostStore` as the primary tier of vLLM's `TieringOffloadingManager`.

        `prepare_read` / `complete_read` pin and unpin chunks a tier reads (a cascade),
        `prepare_write` / `complete_write` allocate and finish chunks a tier fills (a
        promotion): the store's own `prepare_load` (without a request: no access
        recorded, as vLLM's `prepare_read`), `complete_load`, `prepare_store`,
        `complete_store`. `get_kv_memoryview()` is `[num_chunks, row_bytes]` over the
        rows the workers write.
        """

        def __init__(
            self,
            store: HostStore,
            config_info: ConfigInfoMapping | None,
            region: SharedHostRegion,
            tokens_per_chunk: int | None = None,
        ) -> None:
            super().__init__(store, config_info, tokens_per_chunk)
            self._num_chunks = store.num_chunks
            self._region = region
            # The array's own memoryview (numpy types ndarray as a Buffer from Python 3.12).
            self._kv_memoryview = region.array.reshape(store.num_chunks, -1).data
            self.complete_read = store.complete_load
            self.prepare_write = self.prepare_store
            self.complete_write = self.complete_store

        def prepare_read(
            self, keys: Collection[OffloadKey], req_context: object
        ) -> CPULoadStoreSpec:
            return CPULoadStoreSpec(self.store.prepare_load(keys))

        def get_kv_memoryview(self) -> memoryview:
            return self._kv_memoryview

        def shutdown(self) -> None:
            with contextlib.suppress(BufferError):  # a tier may still hold a view
                self._kv_memoryview.release()
            self._region.close()

    return JaxPrimaryTier


def build_tiering_manager(spec: Any, store: HostStore) -> TieringOffloadingManager:
    """vLLM's `TieringOffloadingManager` over `store` and the spec's tiers.

    `spec` is our `JaxOffloadingSpec` (a class made at run time: vLLM's `OffloadingSpec`
    with the host tier's sizing, hence Any), handed to vLLM's tier factory as well."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

    from jax_kvoffload.bridge._vllm_metrics import tokens_per_chunk

    host: HostTierConfig = spec.host_tier
    if host.store_threshold >= 2:  # vLLM's TieringOffloadingSpec refuses it too
        raise ConfigFieldError(
            "kv_connector_extra_config['store_threshold']",
            f"{host.store_threshold} is not supported with secondary_tiers; drop one of them",
        )
    if spec.num_chunks < 1:
        raise ConfigFieldError(
            "kv_connector_extra_config['cpu_bytes_to_use']",
            "buys no host chunk: secondary tiers pass every byte through the host tier",
        )
    slot = max(spec.offloading_config.parallel.world_size, 1)
    region = _region(spec.offloading_config, spec.num_chunks, spec.kv_bytes_per_chunk, slot)
    primary = tiers = None
    try:
        tokens = tokens_per_chunk(spec.offloading_config)  # the snapshot's hit tokens
        primary = build_primary_class()(store, spec.cpu_info.as_config_info(), region, tokens)
        view = primary.get_kv_memoryview()
        tiers = []
        for i, entry in enumerate(vllm_tier_dicts(host)):
            tiers.append(SecondaryTierFactory.create_secondary_tier(entry, view, spec))
            logger.info("secondary tier #%d (%s)", i, tiers[-1].tier_type)
        return TieringOffloadingManager(
            primary_tier=primary,
            secondary_tiers=tiers,
            tier_poll_interval_s=host.tier_poll_interval_s,
        )
    except BaseException:  # on any exit: the tiers and the host tier are shut down
        for tier in reversed(tiers or []):
            with contextlib.suppress(Exception):
                tier.shutdown()
        if primary is not None:
            primary.shutdown()
        else:
            region.close()
        raise
