"""Canonical mappings for every layer and every rank, and fail-closed registration.

`derive_layer_mappings` is vLLM 0.33.0's `derive_canonical_mappings` (`canonical_mapping.py`)
kept for all ranks of the TP x PCP group instead of only this worker's, with the reason of
each refusal. `register_canonical_layout` is what a worker calls at registration: with
`canonical_layout` requested it refuses (a `CanonicalLayoutError`) instead of silently
storing opaque pages, as vLLM's `TieringOffloadingSpec.create_worker` does
(`vllm/v1/kv_offload/tiering/spec.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jax_kvoffload.config._boundary import OffloadingConfig
from jax_kvoffload.config._canonical import CanonicalPageMapping, KVTensorView, RankContext
from jax_kvoffload.config._canonical_layer import (
    layer_mapping_or_reason,
    opaque_fallback_mapping,
    unpadded_page_size,
    verify_tiling,
)
from jax_kvoffload.config._engine import EngineConfig
from jax_kvoffload.config._errors import OffloadConfigError
from jax_kvoffload.config._kv_cache import KVCacheConfig
from jax_kvoffload.config._specs import UniformTypeKVCacheSpecs

logger = logging.getLogger(__name__)

LayerViews = Mapping[str, "KVTensorView | Sequence[KVTensorView] | None"]


class CanonicalLayoutError(OffloadConfigError):
    """`canonical_layout` was requested but a layer cannot be certified, or the config
    claimed parallelism agnosticism that the layers do not have. `layer` and `reason`
    say which and why; the message says how to proceed."""

    def __init__(self, message: str, *, layer: str | None, reason: str) -> None:
        super().__init__(message)
        self.layer = layer
        self.reason = reason


@dataclass(frozen=True)
class LayerCanonicalMappings:
    """One layer's mappings for every rank of the TP x PCP group (rank order).

    `refusal` is None when the layer is certified; otherwise it says why, and `mappings`
    are opaque fallbacks (each rank's page whole, at its own offset; not portable).
    """

    layer: str
    group_id: int
    mappings: tuple[CanonicalPageMapping, ...]
    refusal: str | None = None

    @property
    def certified(self) -> bool:
        return self.refusal is None

    @property
    def portable(self) -> bool:
        return self.certified and all(m.parallelism_agnostic for m in self.mappings)


def rank_contexts(engine_config: EngineConfig) -> tuple[RankContext, ...]:
    """The contexts of every rank of the TP x PCP group."""
    p = engine_config.parallel_config
    tp, pcp = p.tensor_parallel_size, p.prefill_context_parallel_size
    return tuple(
        RankContext(
            tp_size=tp,
            dcp_size=p.decode_context_parallel_size,
            pcp_size=pcp,
            interleave=p.cp_kv_cache_interleave_size,
            total_kv_heads=engine_config.model_config.get_total_num_kv_heads(),
            rank=rank,
        )
        for rank in range(tp * pcp)
    )


def derive_layer_mappings(
    engine_config: EngineConfig, kv_cache_config: KVCacheConfig, views: LayerViews
) -> dict[str, LayerCanonicalMappings]:
    """Mappings of every layer of every group (offloaded or not) for every rank.

    Empty when the workers are not exactly the TP x PCP group (e.g. any pipeline
    parallelism). Layers whose spec is neither attention nor Mamba get no entry; a layer
    refused at any rank gets opaque fallbacks of its unpadded page at every rank. Raises
    `CanonicalTilingError` if a derivation does not tile (never for certified inputs).
    """
    p = engine_config.parallel_config
    group_size = p.tensor_parallel_size * p.prefill_context_parallel_size
    if p.world_size != group_size:
        return {}
    contexts = rank_contexts(engine_config)
    num_blocks = kv_cache_config.num_blocks
    out: dict[str, LayerCanonicalMappings] = {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec_of = group.kv_cache_spec
        per_layer = spec_of.kv_cache_specs if isinstance(spec_of, UniformTypeKVCacheSpecs) else {}
        for layer in group.layer_names:
            spec = per_layer.get(layer, spec_of)
            view = views.get(layer)
            per_rank: list[CanonicalPageMapping] = []
            refusal = None
            for ctx in contexts:
                got = layer_mapping_or_reason(spec, view, num_blocks, ctx)
                if isinstance(got, str):
                    refusal = f"rank {ctx.rank}: {got}"
                    break
                per_rank.append(got)
            if refusal is not None:
                page = unpadded_page_size(spec)
                if page is None:
                    continue
                per_rank = [opaque_fallback_mapping(page, group_size, r) for r in range(group_size)]
            verify_tiling(layer, per_rank)
            out[layer] = LayerCanonicalMappings(layer, gid, tuple(per_rank), refusal)
    return out


def derive_canonical_mappings(
    engine_config: EngineConfig, kv_cache_config: KVCacheConfig, views: LayerViews
) -> dict[str, CanonicalPageMapping]:
    """vLLM's `derive_canonical_mappings`: this worker's (`parallel_config.rank`) mapping
    per layer; empty when the workers are not exactly the TP x PCP group."""
    rank = engine_config.parallel_config.rank
    return {
        name: lm.mappings[rank]
        for name, lm in derive_layer_mappings(engine_config, kv_cache_config, views).items()
    }


@dataclass(frozen=True)
class CanonicalRegistration:
    """The outcome of registration: every layer's mappings (all ranks) and this rank."""

    layers: Mapping[str, LayerCanonicalMappings]
    rank: int
    all_layers_portable: bool

    def mapping(self, layer: str) -> CanonicalPageMapping:
        return self.layers[layer].mappings[self.rank]


_HOW = "remove canonical_layout from kv_connector_extra_config to store opaque per-worker pages"


def register_canonical_layout(
    config: OffloadingConfig,
    engine_config: EngineConfig,
    kv_cache_config: KVCacheConfig,
    views: LayerViews,
) -> CanonicalRegistration:
    """Certifies every layer of every group for every rank; fails closed.

    With `config.canonical_layout` set, raises `CanonicalLayoutError` naming the first
    layer that has no certified mapping (the workers are not exactly the TP x PCP group,
    the layout is packed across layers or unrecognised, the quantisation is per token and
    head, ...). With `config.parallel.is_parallelism_agnostic` claimed, raises unless
    every layer is portable. Without the flag, returns the (possibly opaque) mappings.
    """
    layers = derive_layer_mappings(engine_config, kv_cache_config, views)
    p = engine_config.parallel_config
    if config.canonical_layout:
        group_size = p.tensor_parallel_size * p.prefill_context_parallel_size
        for group in kv_cache_config.kv_cache_groups:
            for name in group.layer_names:
                lm = layers.get(name)
                if lm is None:
                    reason = (
                        f"world_size={p.world_size} is not tensor x prefill-context parallel "
                        f"size ({group_size}): workers must be exactly the TP x PCP group"
                        if not layers
                        else "the layer's spec has no canonical representation"
                    )
                elif lm.refusal is not None:
                    reason = lm.refusal
                else:
                    continue
                raise CanonicalLayoutError(
                    f"canonical_layout was requested but layer {name!r} could not be "
                    f"certified: {reason}; {_HOW}",
                    layer=name,
                    reason=reason,
                )
    portable = bool(layers) and all(lm.portable for lm in layers.values())
    if config.canonical_layout and config.parallel.is_parallelism_agnostic and not portable:
        name = next(n for n, lm in layers.items() if not lm.portable)
        reason = "its canonical page depends on the context-parallel topology"
        raise CanonicalLayoutError(
            f"the config claims is_parallelism_agnostic, but layer {name!r} is not portable "
            f"({reason}); the storage namespace was already shared across topologies: "
            f"{_HOW}, or disable parallelism-agnostic secondary tiers",
            layer=name,
            reason=reason,
        )
    logger.debug(
        "canonical registration: %d layers, rank %d, all portable: %s",
        len(layers),
        p.rank,
        portable,
    )
    return CanonicalRegistration(layers=layers, rank=p.rank, all_layers_portable=portable)
