"""Their caches as our transfer engine sees them: layer-shape groups, layout, namespace.

tpu-inference keeps one array per attention layer in the ragged-paged-attention v3
layout, `(num_blocks, block_size, rows, packing, head_dim)` (docs/tpu_inference.md).
Layers of one page shape form one of our groups (their worker groups them the same
way, `_group_layers_by_shape`: by `shape[2:]`, sorted by its text), so a hybrid model
with two head counts has two groups, and a chunk id addresses one row in each.

Layout: `pallas_kernels`' RPA layout (`KVLayout.rpa()`) where it exists: the arrays
are moved as they are. Before it, each array is viewed as NHD
`(num_blocks, block_size, rows, packing * head_dim)` by a donated reshape (same bytes,
same sharding on the first three axes) and reshaped back after each operation.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

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

__all__ = ["LayerGroups", "group_layers", "namespace_config", "rpa_layout"]

RPA_RANK = 5


def rpa_layout() -> pk.KVLayout | None:
    """`pallas_kernels`' named RPA v3 layout, or None where this version lacks it."""
    make = getattr(pk.KVLayout, "rpa", None)
    return None if make is None else make()


@functools.partial(jax.jit, static_argnums=(1, 2), donate_argnums=0)
def _reshape(arrays: list[jax.Array], shape: tuple[int, ...], sharding: Any) -> list[jax.Array]:
    return [jax.lax.with_sharding_constraint(a.reshape(shape), sharding) for a in arrays]


@dataclass(frozen=True)
class LayerGroups:
    """Layer indices per group (group g: `layers[g]`), their shape and our layout."""

    layers: tuple[tuple[int, ...], ...]
    shapes: tuple[tuple[int, ...], ...]
    layout: pk.KVLayout
    viewed: bool  # arrays go through the NHD view (no RPA layout in pallas_kernels)

    def view(self, caches: Sequence[jax.Array], g: int) -> list[jax.Array]:
        """Group g's arrays in our layout (donated when viewed: read them back with
        `unview`)."""
        arrays = [caches[i] for i in self.layers[g]]
        if not self.viewed:
            return arrays
        b, bs, rows, packing, dim = self.shapes[g]
        return _reshape(arrays, (b, bs, rows, packing * dim), _view_sharding(arrays[0], 4))

    def unview(self, arrays: Sequence[jax.Array], g: int) -> list[jax.Array]:
        if not self.viewed:
            return list(arrays)
        return _reshape(list(arrays), self.shapes[g], _view_sharding(arrays[0], RPA_RANK))

    def write_back(self, caches: list[jax.Array], g: int, arrays: Sequence[jax.Array]) -> None:
        for i, a in zip(self.layers[g], self.unview(arrays, g), strict=True):
            caches[i] = a


def _view_sharding(array: jax.Array, rank: int) -> Any:
    sharding = array.sharding
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec)[:3]  # blocks, tokens, rows: what the RPA layout shards
    return NamedSharding(sharding.mesh, P(*spec, *([None] * (rank - len(spec)))))


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
        by_shape.setdefault(shape[2:], []).append(i)
    order = sorted(by_shape, key=str)
    first = tuple(int(d) for d in caches[0].shape)
    shapes = tuple((first[0], first[1], *s) for s in order)
    layout = rpa_layout()
    return LayerGroups(
        layers=tuple(tuple(by_shape[s]) for s in order),
        shapes=shapes,
        layout=layout if layout is not None else pk.KVLayout.nhd(),
        viewed=layout is None,
    )


def namespace_config(
    model: str, block_size: int, dtype: Any, shape: tuple[int, ...], layers: int, bytes_: int
) -> OffloadingConfig:
    """The `OffloadingConfig` whose namespace keys this engine's tier entries: the model
    name, block size, dtype and one layer-shape group's geometry (the page itself is in
    the namespace too: `engine_pages`). Engines that share these read each other's
    entries; the topology is not in it (a chunk holds every shard's bytes)."""
    _, bs, rows, packing, dim = shape
    name = np.dtype(dtype).name
    spec = FullAttentionSpec(
        block_size=bs, num_kv_heads=rows * packing // 2, head_size=dim, dtype=name
    )
    engine = EngineConfig(
        model_config=ModelConfig(model=model, dtype=name, total_num_kv_heads=rows * packing // 2),
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
