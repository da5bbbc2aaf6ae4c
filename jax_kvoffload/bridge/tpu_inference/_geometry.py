"""Their caches as our transfer engine sees them: layer-shape groups, layout, namespace.

tpu-inference keeps one array per attention layer in the ragged-paged-attention v3
layout, `(num_blocks, block_size, rows, packing, head_dim)` (docs/tpu_inference.md).
Layers of one page shape form one of our groups (their worker groups them the same
way, `_group_layers_by_shape`: by `shape[2:]`, sorted by its text), so a hybrid model
with two head counts has two groups, and a chunk id addresses one row in each.

Layout: `pallas_kernels`' RPA layout (`KVLayout.rpa()`): the arrays are moved as they
are, bit-exact, padding included, sharded as theirs (`P(data, None, model)`, or the
block axis over `attn_dp` too); our staging entry is, byte for byte, their chunk
`(1, layers, block_size, rows, packing, head_dim)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
import numpy.typing as npt

import pallas_kernels as pk
from jax_kvoffload.bridge.tpu_inference._errors import TPUConnectorConfigError
from jax_kvoffload.config import (
    CacheConfig,
    EngineConfig,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVTransferConfig,
    ModelConfig,
    OffloadingConfig,
    build_offloading_config,
)
from jax_kvoffload.config.internals import as_dtype

__all__ = ["LayerGroups", "group_layers", "namespace_config"]

RPA_RANK = 5
RPA = pk.KVLayout.rpa()


@dataclass(frozen=True)
class LayerGroups:
    """Layer indices per group (group g: `layers[g]`) and their shapes."""

    layers: tuple[tuple[int, ...], ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def layout(self) -> pk.KVLayout:
        return RPA

    def arrays(self, caches: Sequence[jax.Array], g: int) -> list[jax.Array]:
        return [caches[i] for i in self.layers[g]]

    def write_back(self, caches: list[jax.Array], g: int, arrays: Sequence[jax.Array]) -> None:
        for i, a in zip(self.layers[g], arrays, strict=True):
            caches[i] = a


def group_layers(caches: Sequence[jax.Array]) -> LayerGroups:
    """Groups the runner's arrays by page shape (theirs), checked for the RPA rank."""
    if not caches:
        raise TPUConnectorConfigError(
            "runner.kv_caches", [], "register_runner needs the runner's KV caches allocated"
        )
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, cache in enumerate(caches):
        shape = tuple(int(d) for d in cache.shape)
        if len(shape) != RPA_RANK:
            raise TPUConnectorConfigError(
                f"runner.kv_caches[{i}].shape",
                shape,
                "tpu-inference's ragged-paged-attention v3 cache "
                "(num_blocks, block_size, rows, packing, head_dim) expected; MLA and "
                "other layouts are not served by this connector",
            )
        first = tuple(int(d) for d in caches[0].shape)
        if shape[:2] != first[:2]:  # a block id (and a chunk) is one block of every layer
            raise TPUConnectorConfigError(
                f"runner.kv_caches[{i}].shape",
                shape,
                f"every layer needs the (num_blocks, block_size) of layer 0, {first[:2]}: "
                "a block id names the same block in every layer",
            )
        by_shape.setdefault(shape[2:], []).append(i)
    order = sorted(by_shape, key=str)
    shapes = tuple((first[0], first[1], *s) for s in order)
    return LayerGroups(layers=tuple(tuple(by_shape[s]) for s in order), shapes=shapes)


def namespace_config(
    model: str,
    block_size: int,
    dtype: npt.DTypeLike,
    shape: tuple[int, ...],
    layers: int,
    bytes_: int,
) -> OffloadingConfig:
    """The `OffloadingConfig` whose namespace keys this engine's tier entries: the model
    name, block size, dtype and one layer-shape group's geometry (the page itself is in
    the namespace too: `engine_pages`). Engines that share these read each other's
    entries; the topology is not in it (a chunk holds every shard's bytes)."""
    _, bs, rows, packing, dim = shape
    # The dtype by name, checked as the configs check it (their fields hold np.dtypes).
    dtype_ = as_dtype(np.dtype(dtype).name)
    spec = FullAttentionSpec(
        block_size=bs, num_kv_heads=rows * packing // 2, head_size=dim, dtype=dtype_
    )
    engine = EngineConfig(
        model_config=ModelConfig(model=model, dtype=dtype_, total_num_kv_heads=rows * packing // 2),
        cache_config=CacheConfig(block_size=block_size),
        kv_transfer_config=KVTransferConfig(
            kv_connector_extra_config={"cpu_bytes_to_use": bytes_, "blocks_per_chunk": 1},
            engine_id="tpu-inference",
        ),
    )
    names = tuple(f"layers.{i}" for i in range(layers))
    kv = KVCacheConfig(
        num_blocks=shape[0],
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec),),
    )
    return build_offloading_config(engine, kv)
