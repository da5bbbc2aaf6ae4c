"""Block-size resolution: vLLM 0.33.0's `resolve_dcp_kv_block_size` and
`resolve_kv_cache_block_sizes` (vllm/v1/core/kv_cache_utils.py)."""

from __future__ import annotations

import math
from typing import Any

from jax_kvoffload.config._errors import PrefixMatchUnitError, StateAlignmentError
from jax_kvoffload.config._specs import KVCacheSpec, MambaSpec, iter_layer_specs


def resolve_dcp_kv_block_size(spec: KVCacheSpec, dcp_size: int) -> int:
    """Tokens one block spans across DCP ranks: DCP-sharded specs scale, others do not."""
    return spec.block_size * (dcp_size if spec.dcp_sharded else 1)


def resolve_kv_cache_block_sizes(kv_cache_config: Any, engine_config: Any) -> tuple[int, int]:
    """Returns `(scheduler_block_size, hash_block_size)` over *all* groups.

    Quirk kept from vLLM: with one group the answer comes from `cache_config.block_size`
    (times DCP when the group is DCP-sharded), not from the group's spec.
    """
    # Attributes are read in vLLM's order and only where vLLM reads them (its `and` /
    # `or` chains short-circuit), so an engine object behaves as it does under vLLM.
    cache_config = engine_config.cache_config
    dcp = engine_config.parallel_config.decode_context_parallel_size
    groups = kv_cache_config.kv_cache_groups

    if len(groups) <= 1:
        if len(groups) == 1 and not groups[0].kv_cache_spec.dcp_sharded:
            dcp = 1
        bs = cache_config.block_size * dcp
        unit = cache_config.prefix_match_unit
        if (
            unit not in (None, bs)
            and len(groups) == 1
            and (cache_config.enable_prefix_caching or engine_config.kv_transfer_config is not None)
        ):
            raise PrefixMatchUnitError(
                f"Invalid prefix_match_unit={unit}; "
                "with a single KV cache group, prefix-cache hits land on the "
                f"block size ({bs}). Unset it or set it to {bs}.",
                prefix_match_unit=unit,
                block_sizes=(bs,),
            )
        return bs, bs

    sizes = [resolve_dcp_kv_block_size(g.kv_cache_spec, dcp) for g in groups]
    scheduler = math.lcm(*sizes)
    connector_enabled = engine_config.kv_transfer_config is not None
    if not (cache_config.enable_prefix_caching or connector_enabled):
        return scheduler, scheduler
    layer_specs = [(g, s) for g in groups for s in iter_layer_specs(g.kv_cache_spec)]
    if any(isinstance(s, MambaSpec) and s.mamba_cache_mode != "align" for _, s in layer_specs):
        # Mamba outside align mode breaks divisibility: back off to the scheduler size.
        return scheduler, scheduler

    hashing = [
        size for g, size in zip(groups, sizes, strict=True) if g.kv_cache_spec.prefix_cacheable
    ] or sizes
    unit = cache_config.prefix_match_unit
    hash_size = unit if unit is not None else math.gcd(*hashing)
    if any(size % hash_size for size in hashing):
        raise PrefixMatchUnitError(
            f"Invalid prefix_match_unit={hash_size}; prefix-cacheable "
            "KV cache group block sizes must be divisible by prefix_match_unit. "
            f"Got group block sizes={sizes}, prefix-cacheable={hashing}. Unset it or use "
            f"a divisor of them all, e.g. {math.gcd(*hashing)}.",
            prefix_match_unit=hash_size,
            block_sizes=tuple(sizes),
        )
    alignments = {
        tokens_per_state
        for _, s in layer_specs
        if s.prefix_cacheable
        and isinstance(tokens_per_state := getattr(s, "tokens_per_state", None), int)
        and tokens_per_state > 1
    }
    partial_mamba = any(
        isinstance(s, MambaSpec)
        and s.mamba_cache_mode == "align"
        and ((dcp == 1 and size > hash_size) or (dcp > 1 and size >= hash_size))
        for g, size in zip(groups, sizes, strict=True)
        for s in iter_layer_specs(g.kv_cache_spec)
    )
    hit_alignment = hash_size if partial_mamba else scheduler
    if any(hit_alignment % a for a in alignments):
        raise StateAlignmentError(
            f"Invalid prefix_match_unit={hash_size}; prefix-cache boundaries "
            "must align with each spec's per-state compression. "
            f"Got alignments={sorted(alignments)}. Use a prefix_match_unit (or block "
            f"sizes) divisible by {math.lcm(*alignments)}.",
            alignment=hit_alignment,
            alignments=tuple(sorted(alignments)),
        )
    return scheduler, hash_size
