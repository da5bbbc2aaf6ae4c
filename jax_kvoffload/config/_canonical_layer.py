"""Per-layer canonical certification: the mapping or the refusal, the opaque fallback and
the tiling proof (vLLM 0.33.0 `_layer_mapping` and its tiling check in `canonical_mapping.py`)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from jax_kvoffload.config._canonical import (
    ByteRegion,
    CanonicalPageMapping,
    CopyRun,
    KVTensorView,
    RankContext,
    _byte_regions,
    interleave_tokens,
)
from jax_kvoffload.config._errors import OffloadConfigError
from jax_kvoffload.config._kv_cache import KVCacheLayout
from jax_kvoffload.config._specs import AttentionSpec, KVCacheSpec, MambaSpec, MLAAttentionSpec

# Version of the canonical byte format; bump on any change of the page encoding.
CANONICAL_FORMAT_VERSION = 1


class CanonicalTilingError(OffloadConfigError):
    """The derived runs of a layer do not tile its local or canonical page (a bug in the
    derivation or an inconsistent input); vLLM asserts here. `layer` names the layer."""

    def __init__(self, layer: str, message: str) -> None:
        super().__init__(f"layer {layer!r}: {message}")
        self.layer = layer


def canonical_format_id(kv_cache_layout: str) -> str:
    """Identity of the canonical byte format: `"v1-nhd"` (LBNHC), `"v1-hnd"` (LBHNC), else
    `"v1-<member name lower-cased>"`. Unknown names, the legacy `"NHD"` included, raise
    `KeyError` like vLLM's enum lookup."""
    layout = KVCacheLayout[kv_cache_layout]
    legacy = {KVCacheLayout.LBNHC: "nhd", KVCacheLayout.LBHNC: "hnd"}
    return f"v{CANONICAL_FORMAT_VERSION}-{legacy.get(layout, layout.name.lower())}"


def layer_mapping_or_reason(
    spec: KVCacheSpec,
    view: KVTensorView | Sequence[KVTensorView] | None,
    num_blocks: int,
    ctx: RankContext,
) -> CanonicalPageMapping | str:
    """The certified mapping of one layer at one rank, or why it cannot be certified.

    `view` is the worker's physical cache of the layer (ignored for MLA); a sequence of
    views (several tensors for one layer) or None is refused for other attention, as vLLM
    refuses a list or a missing tensor.
    """
    if not isinstance(spec, AttentionSpec):
        return f"{type(spec).__name__} is not an attention spec"
    bs = spec.block_size
    page = spec.real_page_size_bytes
    if ctx.cp_size > 1 and (ctx.interleave > bs or bs % ctx.interleave):
        return (
            f"cp_kv_cache_interleave_size={ctx.interleave} must divide block_size={bs} "
            "when context parallelism shards tokens"
        )
    if isinstance(spec, MLAAttentionSpec):
        # The latent is TP-replicated; CP shards its tokens across the DCP groups.
        if spec.tokens_per_state != 1:
            return f"MLA tokens_per_state={spec.tokens_per_state} (compressed states) != 1"
        if page % bs:
            return f"MLA page of {page} bytes is not a whole number of {bs} token rows"
        if ctx.tp_size % ctx.dcp_size:
            return f"tensor parallel size {ctx.tp_size} is not a multiple of DCP {ctx.dcp_size}"
        if spec.kv_quant_mode.is_per_token_head:
            return f"per-token-head quantisation ({spec.kv_quant_mode.name})"
        row = page // bs
        return CanonicalPageMapping(
            canonical_page_size_bytes=ctx.cp_size * page,
            local_page_size_bytes=page,
            runs=interleave_tokens([ByteRegion(0, 0, row, row)], bs, ctx),
            num_writers=ctx.tp_size // ctx.dcp_size,
            writer_index=ctx.tp_rank // ctx.dcp_size,
            parallelism_agnostic=ctx.cp_size == 1,
        )
    if spec.kv_quant_mode.is_per_token_head:
        return f"per-token-head quantisation ({spec.kv_quant_mode.name})"
    if not isinstance(view, KVTensorView):
        what = "no tensor" if view is None else "several tensors"
        return f"the layer has {what}; one KV tensor per layer is required"
    total, tp = ctx.total_kv_heads, ctx.tp_size
    if spec.num_kv_heads != max(1, total // tp):
        return (
            f"num_kv_heads={spec.num_kv_heads} != max(1, total KV heads {total} // "
            f"tensor parallel size {tp})"
        )
    if total >= tp:
        if total % tp:
            return f"total KV heads {total} is not a multiple of tensor parallel size {tp}"
        shards, replication = tp, 1
    else:
        if tp % total:
            return f"tensor parallel size {tp} is not a multiple of total KV heads {total}"
        shards, replication = total, tp // total
    if replication % ctx.dcp_size:
        # DCP may only shard tokens across ranks that hold the same heads.
        return f"head replication {replication} is not a multiple of DCP {ctx.dcp_size}"
    shard = ctx.tp_rank // replication
    regions = _byte_regions(view, spec, num_blocks, shard, shards, ctx.cp_size)
    if isinstance(regions, str):
        return regions
    return CanonicalPageMapping(
        canonical_page_size_bytes=ctx.cp_size * shards * page,
        local_page_size_bytes=page,
        runs=interleave_tokens(regions, bs, ctx),
        num_writers=replication // ctx.dcp_size,
        writer_index=(ctx.tp_rank % replication) // ctx.dcp_size,
        parallelism_agnostic=ctx.cp_size == 1,
    )


def layer_mapping(
    spec: KVCacheSpec,
    view: KVTensorView | Sequence[KVTensorView] | None,
    num_blocks: int,
    ctx: RankContext,
) -> CanonicalPageMapping | None:
    """vLLM's `_layer_mapping`: the certified mapping, or None (fail closed)."""
    out = layer_mapping_or_reason(spec, view, num_blocks, ctx)
    return None if isinstance(out, str) else out


def opaque_fallback_mapping(
    page_size_bytes: int, num_ranks: int, rank: int
) -> CanonicalPageMapping:
    """The worker's page whole, at a worker-exclusive offset: stored, never portable."""
    p = page_size_bytes
    return CanonicalPageMapping(
        canonical_page_size_bytes=num_ranks * p,
        local_page_size_bytes=p,
        runs=(CopyRun(0, rank * p, p, 1, p, p),),
        num_writers=1,
        writer_index=0,
        parallelism_agnostic=False,
    )


def unpadded_page_size(spec: KVCacheSpec) -> int | None:
    """The page without alignment padding (attention, Mamba); None for other specs."""
    if isinstance(spec, (AttentionSpec, MambaSpec)):
        return spec.real_page_size_bytes
    return None


def _intervals(mapping: CanonicalPageMapping, canonical: bool) -> list[tuple[int, int]]:
    return sorted((c, c + n) if canonical else (lo, lo + n) for lo, c, n in mapping.fragments())


def _exact_partition(intervals: list[tuple[int, int]], size: int) -> bool:
    return (
        bool(intervals)
        and intervals[0][0] == 0
        and intervals[-1][1] == size
        and all(a[1] == b[0] for a, b in itertools.pairwise(intervals))
    )


def verify_tiling(layer: str, per_rank: Sequence[CanonicalPageMapping]) -> None:
    """Raises `CanonicalTilingError` unless every rank's runs cover its local page exactly
    once and, for each block, the ranks elected as writers tile the canonical page
    exactly once."""
    if not per_rank:
        raise CanonicalTilingError(layer, "no rank mappings to verify")
    size = per_rank[0].canonical_page_size_bytes
    writers = per_rank[0].num_writers
    for rank, m in enumerate(per_rank):
        if m.canonical_page_size_bytes != size or m.num_writers != writers:
            raise CanonicalTilingError(
                layer,
                f"rank {rank} has canonical page {m.canonical_page_size_bytes} B and "
                f"{m.num_writers} writers; rank 0 has {size} B and {writers}",
            )
        if not _exact_partition(_intervals(m, False), m.local_page_size_bytes):
            raise CanonicalTilingError(
                layer, f"runs of rank {rank} do not cover the local page exactly once"
            )
    for block in range(writers):
        stored = sorted(iv for m in per_rank if m.is_writer(block) for iv in _intervals(m, True))
        if not _exact_partition(stored, size):
            raise CanonicalTilingError(
                layer, f"writers of block {block} do not tile the canonical page exactly once"
            )
