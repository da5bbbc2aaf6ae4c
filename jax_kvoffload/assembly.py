"""Builds the host tier from one `HostTierConfig`: the store, the pool and the tiers.

`KVOffloader` (one process: all three) and `JaxOffloadingSpec` (vLLM: the store and
the tiers on the scheduler side, the pool on each worker) size and build them here, so
both read the extra config once (`jax_kvoffload.config.host_tier_config`) and apply the
same rules: capacity as vLLM's CPU tier (`cpu_tier_capacity`), the store's options as
vLLM's `CPUOffloadingSpec.get_manager` passes them, the pool `host_pool` names
(`jax_kvoffload.hostmem.build_host_pool`, where every host pool is built), the tiers in
the namespace of the engine's `OffloadingConfig`.

Sits above `store`, `transfer`, `hostmem` and `tiers` (which never import each other,
except `transfer`, which moves bytes into `hostmem`'s pools).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from jax_kvoffload.config import HostTierConfig, OffloadingConfig, TierConfigError, VllmTierConfig
from jax_kvoffload.config.internals import kind_names_in_words
from jax_kvoffload.hostmem import HostPool, build_host_pool
from jax_kvoffload.store import CPUTierCapacity, HostStore, cpu_tier_capacity
from jax_kvoffload.tiers import SecondaryTier, namespace_digest, namespace_fields, open_tier
from jax_kvoffload.transfer import GroupCaches

__all__ = [
    "HostTierParts",
    "assemble_host_tier",
    "build_store",
    "engine_pages",
    "host_capacity",
    "open_tiers",
]

logger = logging.getLogger(__name__)


@dataclass
class HostTierParts:
    """What `assemble_host_tier` built: close `tiers` when done (the rest is memory)."""

    host: HostTierConfig
    capacity: CPUTierCapacity
    store: HostStore
    pool: HostPool
    tiers: tuple[SecondaryTier, ...]


def host_capacity(
    host: HostTierConfig,
    *,
    worker_kv_bytes_per_block: int,
    blocks_per_chunk: int,
    world_size: int,
    replicated_layout: bool,
) -> CPUTierCapacity:
    """The host tier's geometry from the byte budget, as vLLM's `CPUOffloadingSpec`."""
    return cpu_tier_capacity(
        host.cpu_bytes_to_use,
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        blocks_per_chunk=blocks_per_chunk,
        world_size=world_size,
        replicated_layout=replicated_layout,
    )


def build_store(host: HostTierConfig, num_chunks: int, *, enable_events: bool) -> HostStore:
    """The `HostStore`, with the options vLLM's `CPUOffloadingSpec.get_manager` passes."""
    return HostStore(num_chunks, enable_events=enable_events, **host.store_kwargs())


def engine_pages(caches: Mapping[int, GroupCaches]) -> list[dict[str, object]]:
    """How a JAX engine's caches lay out one block, per group: what a tier namespace
    needs beyond the config, which names neither the page format (NHD, HND, ...) nor
    how K and V are arranged nor the page's shape (heads, head size). Global arrays
    give the same pages on any mesh, so this does not depend on the sharding."""
    out: list[dict[str, object]] = []
    for g in sorted(caches):
        gc = caches[g]
        first = gc.arrays[0]
        out.append(
            {
                "group": g,
                "page_format": gc.layout.page_format.value,
                "kv_stacking": gc.layout.kv_stacking.value,
                "arrays": len(gc.arrays),
                "page_shape": list(gc.host_page_shape[1:]),  # canonical RPA: no padding
                "itemsize": first.dtype.itemsize,
            }
        )
    return out


def open_tiers(
    config: OffloadingConfig, host: HostTierConfig, *, rank: int | None = None, pages: object = None
) -> tuple[SecondaryTier, ...]:
    """Our tiers of `host.secondary_tiers`, in order, in the config's namespace (with
    `pages`, e.g. `engine_pages(caches)`, where the config does not describe them).

    `rank=None`: a payload holds every worker's bytes of a chunk (one JAX process
    driving the whole mesh; vLLM's scheduler-side rows). vLLM's own tier types only
    vLLM builds: `JaxOffloadingSpec` hands those to vLLM's tier factory instead.
    If one tier cannot be opened, those opened before it are closed again.
    """
    namespace = namespace_digest(config, rank=rank, pages=pages)
    describe = namespace_fields(config, rank=rank, pages=pages)
    opened: list[SecondaryTier] = []
    try:
        for i, tier in enumerate(host.secondary_tiers):
            if isinstance(tier, VllmTierConfig):
                raise TierConfigError(
                    f"secondary_tiers[{i}]",
                    "type",
                    tier.type,
                    "is a tier only vLLM's tiering manager can build (a JAX engine "
                    f"opens {kind_names_in_words('and')} tiers); use one of those here",
                )
            opened.append(open_tier(tier, namespace, describe=describe))
            logger.info("secondary tier %d: %s", i, type(opened[-1]).__name__)
    except BaseException:  # on any exit: the tiers opened so far are closed
        for opened_tier in reversed(opened):
            opened_tier.close()
        raise
    return tuple(opened)


def assemble_host_tier(
    config: OffloadingConfig,
    host: HostTierConfig,
    *,
    bytes_per_block: Mapping[int, int],
    worker_kv_bytes_per_block: int,
    world_size: int = 1,
    replicated_layout: bool = False,
    enable_events: bool = False,
    tiers: tuple[SecondaryTier, ...] | None = None,
    pages: object = None,
    accelerator: bool = False,
) -> HostTierParts:
    """Store + pool + tiers for one process that is both scheduler and worker.

    Args:
      config: the boundary (its namespace keys the tiers' entries).
      host: the parsed host-tier keys (`host_tier_config(config.extra_config)`).
      bytes_per_block: group -> bytes per block of the pool's rows.
      worker_kv_bytes_per_block, world_size, replicated_layout: the capacity's inputs.
      enable_events: the store records KV events.
      tiers: tiers already opened (used instead of opening `host.secondary_tiers`).
      pages: the engine's page description for the tiers' namespace (`engine_pages`).
      accelerator: the caches are on a GPU or TPU (`host_pool="auto"` is "pinned").
    """
    capacity = host_capacity(
        host,
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        blocks_per_chunk=config.cache.blocks_per_chunk,
        world_size=world_size,
        replicated_layout=replicated_layout,
    )
    store = build_store(host, capacity.num_chunks, enable_events=enable_events)
    pool, _ = build_host_pool(
        store.num_chunks,
        bytes_per_block,
        config.cache.blocks_per_chunk,
        kind=host.host_pool,
        accelerator=accelerator,
    )
    if tiers is None:
        opened = open_tiers(config, host, pages=pages)
    else:
        opened = tuple(tiers)
        namespace = namespace_digest(config, pages=pages)
        for i, tier in enumerate(opened):
            if tier.namespace != namespace:  # the caller's choice: said, not refused
                logger.warning(
                    "secondary tier %d (%s) was opened in namespace %s, not this engine's "
                    "%s (namespace_digest(config, pages=engine_pages(caches))): entries of "
                    "engines whose pages differ may be read as this engine's",
                    i,
                    type(tier).__name__,
                    tier.namespace.hex()[:16],
                    namespace.hex()[:16],
                )

    return HostTierParts(host=host, capacity=capacity, store=store, pool=pool, tiers=opened)
