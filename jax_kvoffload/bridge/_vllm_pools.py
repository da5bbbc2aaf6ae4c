"""Host pools for vLLM workers: canonical pages, and one shared copy of replicated pages.

vLLM's connector worker attaches a `CanonicalPageMapping` (or None) to every layer ref of
the `CanonicalKVCaches` it hands to `get_worker`. With `canonical_layout` requested,
`canonical_worker_pool` checks them as vLLM's `TieringOffloadingSpec.create_worker` does and
fails closed; then builds this rank's relayout plans and the host pool that all ranks of
the TP x PCP group share (a `SharedHostRegion` when there are several worker processes),
seen through a `CanonicalPoolView` with this rank's page widths.

`shared_direct_pool` is the replicated layout without canonical pages (MLA's latent is
the same on every TP rank): one region for all workers, which vLLM lets only rank 0
write (its connector gates stores on the spec's `replicated_layout`); every rank loads.

Uses vLLM's objects by attribute only; imports neither vLLM nor torch (nor JAX until a
canonical pool is built: `hostmem` is JAX-free).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

from jax_kvoffload.config import CanonicalLayoutError, OffloadingConfig
from jax_kvoffload.config.canonical import CanonicalPageMapping, CopyRun
from jax_kvoffload.hostmem import (
    HostChunkPool,
    HostPool,
    SharedHostRegion,
    SharedRows,
    build_host_pool,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import CanonicalKVCaches
    from vllm.v1.kv_offload.base import CanonicalPageMapping as VllmCanonicalPageMapping

    from jax_kvoffload.transfer import CanonicalPoolView

__all__ = ["CanonicalWorkerError", "canonical_worker_pool", "our_mapping", "shared_direct_pool"]

logger = logging.getLogger(__name__)

_ADVICE = "Remove 'canonical_layout' from kv_connector_extra_config to store direct pages."


class CanonicalWorkerError(CanonicalLayoutError, RuntimeError):
    """`canonical_layout` was requested but the worker's KV caches cannot be stored as
    canonical pages. A `ValueError` like every config error of this library, and a
    `RuntimeError` like the error vLLM's tiering spec raises in the same place."""


def our_mapping(mapping: VllmCanonicalPageMapping) -> CanonicalPageMapping:
    """vLLM's `CanonicalPageMapping` as ours (same fields, validated)."""
    return CanonicalPageMapping(
        canonical_page_size_bytes=int(mapping.canonical_page_size_bytes),
        local_page_size_bytes=int(mapping.local_page_size_bytes),
        runs=tuple(
            CopyRun(
                int(r.local_offset),
                int(r.canonical_offset),
                int(r.fragment_size),
                int(r.num_fragments),
                int(r.local_stride),
                int(r.canonical_stride),
            )
            for r in mapping.runs
        ),
        num_writers=int(mapping.num_writers),
        writer_index=int(mapping.writer_index),
        parallelism_agnostic=bool(mapping.parallelism_agnostic),
    )


def tensor_mappings(
    kv_caches: CanonicalKVCaches, config: OffloadingConfig
) -> tuple[dict[int, CanonicalPageMapping], bool]:
    """One mapping per registered tensor, and whether every layer is portable.

    Raises `CanonicalWorkerError` (fail closed) for a layer without a mapping, for a
    config that claimed parallelism agnosticism its layers do not have, and for a tensor
    whose refs carry different mappings."""
    per_tensor: dict[int, CanonicalPageMapping] = {}
    for g, refs in enumerate(kv_caches.group_data_refs):
        for i, ref in enumerate(refs):
            where = f"group {g} layer {i} (tensor {ref.tensor_idx})"
            if ref.mapping is None:
                raise CanonicalWorkerError(
                    f"canonical_layout was requested but {where} could not be certified "
                    "for canonical pages (workers must be exactly the TP x PCP group; "
                    "packed cross-layer layouts, per-token-head quantisation and "
                    f"unrecognised page layouts are refused). {_ADVICE}",
                    layer=where,
                    reason="uncertified",
                )
            m = our_mapping(ref.mapping)
            seen = per_tensor.setdefault(ref.tensor_idx, m)
            if seen != m:
                raise CanonicalWorkerError(
                    f"{where} maps its pages differently from another layer on the same "
                    "tensor (hybrid groups sharing a tensor); canonical pages need one "
                    f"mapping per tensor. {_ADVICE}",
                    layer=where,
                    reason="several mappings for one tensor",
                )
    portable = all(m.parallelism_agnostic for m in per_tensor.values())
    if config.parallel.is_parallelism_agnostic and not portable:
        raise CanonicalWorkerError(
            "canonical_layout could not certify every layer as parallelism-agnostic, but "
            "the config declared the storage portable across topologies "
            f"(is_parallelism_agnostic). {_ADVICE}",
            layer=None,
            reason="not parallelism-agnostic",
        )
    return per_tensor, portable


def region_name(engine_id: str) -> str:
    """The shared region's name for an engine. vLLM's `engine_id` is a random uuid unless
    set (distinct per DP replica); the region adds the user id and hashes it, and only
    processes of this user may join (docs/security.md)."""
    return f"vllm-engine:{engine_id}"


def group_missing(region: SharedHostRegion | None) -> str | None:
    """Why the workers cannot use the shared region yet, or None when all have joined.

    Every rank of the group must map the region before pages are stored or loaded: with
    writer rotation a rank's loads read bytes other ranks wrote. Ranks on another host
    never join (a region is one host's memory), so canonical pages across hosts fail
    here instead of loading bytes nobody wrote."""
    if region is None:
        return None
    attached, want = region.attachments()
    if attached >= want:
        return None
    return (
        f"only {attached} of the {want} worker processes have mapped the shared host region "
        f"{region.name!r}; every rank of the group must run on this host, in one network "
        "namespace (they find each other by abstract Unix sockets), as the same user"
    )


def canonical_worker_pool(
    kv_caches: CanonicalKVCaches,
    config: OffloadingConfig,
    *,
    num_chunks: int,
    blocks_per_chunk: int,
    widths: Mapping[int, int],
    shared: SharedRows | None = None,
) -> tuple[CanonicalPoolView, SharedHostRegion | None]:
    """This rank's `CanonicalPoolView` and the shared region behind it (None with one
    worker process). `widths[t]` is the unpadded page of tensor t's refs (the bytes the
    worker moves per block; vLLM's `mapping.local_page_size_bytes`).

    `shared`: the rows to build the pool over instead of the workers' own region (with
    secondary tiers, the rows the scheduler's tiers read: `tiered_canonical_rows`)."""
    # Imported here: `jax_kvoffload.bridge.vllm` (loaded by vLLM's scheduler too) stays
    # free of JAX until a worker is built.
    from jax_kvoffload.transfer import CanonicalPoolView, TransferError, plan_for_group

    mappings, portable = tensor_mappings(kv_caches, config)
    missing = sorted(set(range(len(kv_caches.tensors))) - set(mappings))
    if missing:
        raise CanonicalWorkerError(
            f"tensors {missing} are referenced by no layer; canonical pages need a mapping "
            f"for every registered tensor. {_ADVICE}",
            layer=None,
            reason="unreferenced tensor",
        )
    try:
        plans = {t: plan_for_group([mappings[t]], [widths[t]]) for t in widths}
    except TransferError as e:
        raise CanonicalWorkerError(
            f"a layer's canonical mapping does not cover its unpadded page: {e}. {_ADVICE}",
            layer=None,
            reason="mapping does not match the page",
        ) from e
    rows = {t: p.canonical_block_bytes for t, p in plans.items()}
    if shared is None:
        pool, region = _pool(config, "", num_chunks, rows, blocks_per_chunk)
    else:
        _check_row(config, shared, blocks_per_chunk * sum(rows.values()))
        pool, region = build_host_pool(num_chunks, rows, blocks_per_chunk, shared=shared)
    logger.info(
        "canonical host pages: rank %d of %d, %d tensors, %d canonical bytes per block, "
        "all layers portable: %s",
        config.parallel.rank,
        config.parallel.world_size,
        len(plans),
        sum(rows.values()),
        portable,
    )
    # `_pool` builds a numpy pool (a HostChunkPool), the only kind a view goes over.
    return CanonicalPoolView(cast(HostChunkPool, pool), plans), region


def _check_row(config: OffloadingConfig, shared: SharedRows, need: int) -> None:
    """The canonical pages of a chunk fit the scheduler's row (sized by the config)."""
    if shared.row_stride is not None and need > shared.row_stride:
        raise CanonicalWorkerError(
            f"a chunk's canonical pages take {need} bytes but a host row holds "
            f"{shared.row_stride} (worker_kv_bytes_per_block="
            f"{config.worker_kv_bytes_per_block} x world size x blocks per chunk): the KV "
            f"cache description does not match the tensors. {_ADVICE}",
            layer=None,
            reason="canonical pages larger than a host row",
        )


def shared_direct_pool(
    config: OffloadingConfig,
    *,
    num_chunks: int,
    blocks_per_chunk: int,
    widths: Mapping[int, int],
) -> tuple[HostPool, SharedHostRegion | None]:
    """One pool of direct pages (`widths[t]` bytes per block of tensor t: its unpadded
    page) in a region that every worker process of the engine maps (`world_size`)."""
    widths = dict(widths)
    pool, region = _pool(config, "_replicated", num_chunks, widths, blocks_per_chunk)
    logger.info(
        "replicated host pages: one copy for %d workers (%d bytes per block)",
        config.parallel.world_size,
        sum(widths.values()),
    )
    return pool, region


def _pool(
    config: OffloadingConfig,
    suffix: str,
    num_chunks: int,
    widths: dict[int, int],
    blocks_per_chunk: int,
) -> tuple[HostPool, SharedHostRegion | None]:
    """A pool of `widths` rows, over a region every worker maps when there are several
    (named after the engine, plus `suffix`), else in this process's own memory."""
    world = config.parallel.world_size
    shared = None
    if world > 1:
        shared = SharedRows(region_name(config.engine_id) + suffix, world, config.parallel.rank)
    return build_host_pool(num_chunks, widths, blocks_per_chunk, shared=shared)
