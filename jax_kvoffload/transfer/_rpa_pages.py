"""Canonical host pages of ragged-paged-attention (RPA) v3 caches.

An RPA engine on S KV-head shards gives each shard `align(2H/S, packing)` slots of which
`2H/S` are real (`pallas_kernels.rpa_cache_shape`): where a shard pads (fp8 with 4 heads
on 4 shards, any odd head count in fp8/int8), the global array, and so the page the
kernels gather, depends on S. A group handed over with `canonical_kv_heads=H` keeps
canonical host pages instead: `[layers, block_size, 2H, head_dim]`, the real slots only,
the same bytes for every S (and exactly the gathered bytes wherever no shard pads, when
nothing is relaid). Stores relay the gathered staging on the devices
(`pk.rpa_canonical`, integer moves, each device its own slots); loads gather the target
blocks first and write the real slots into them (`pk.rpa_merge_canonical`), so every
padding byte of the target keeps its value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import pallas_kernels as pk
from jax_kvoffload.hostmem.internals import check_index
from jax_kvoffload.transfer._errors import TransferError

if TYPE_CHECKING:
    from jax_kvoffload.transfer._copies import KernelOptions


def check_rpa_heads(
    arrays: Sequence[jax.Array], layout: pk.KVLayout, heads: object, where: str
) -> int:
    """`heads` as an int after checking that every array is a global RPA cache of that
    many KV heads for the mesh sharding it (typed errors name the array and the fix)."""
    if layout.page_format is not pk.PageFormat.RPA:
        raise TransferError(
            f"{where}: canonical_kv_heads is for RPA caches (layout 'rpa'), got layout "
            f"{layout.name!r}: drop it (the global page of that layout is canonical already)"
        )
    heads = check_index("canonical_kv_heads", heads)
    for i, a in enumerate(arrays):
        try:
            pk.check_rpa_geometry(tuple(a.shape), a.dtype, heads, pk.rpa_shards(a))
        except pk.LayoutError as e:
            raise TransferError(f"{where}: arrays[{i}]: {e}") from None
    return heads


def host_page_shape(
    arrays: Sequence[jax.Array], layout: pk.KVLayout, heads: int | None
) -> tuple[int, ...]:
    """`(len(arrays), *page)` of one block on the host: canonical for RPA with heads."""
    shape = tuple(arrays[0].shape)
    if heads is None:
        return (len(arrays), *layout.page_shape(shape))
    return (len(arrays), shape[1], 2 * heads, shape[4])


def relays(arrays: Sequence[jax.Array], heads: int | None) -> bool:
    """Whether these arrays' pages differ from the canonical ones (a shard pads)."""
    if heads is None:
        return False
    return pk.rpa_needs_merge(heads, arrays[0].dtype, pk.rpa_shards(arrays[0]))


def to_canonical(arrays: Sequence[jax.Array], heads: int, staging: jax.Array) -> jax.Array:
    """A store's gathered staging `[n, layers, *rpa_page]` as canonical pages."""
    return pk.rpa_canonical(staging, heads, pk.rpa_shards(arrays[0]))


def canonical_sharding(arrays: Sequence[jax.Array], layout: pk.KVLayout) -> NamedSharding | None:
    """Where a load's canonical staging goes: the kernels' staging sharding with the
    packing axis dropped (the slots stay split over the same devices), or None."""
    sharding = pk.staging_sharding(arrays, layout)
    if sharding is None:
        return None
    spec = tuple(sharding.spec) + (None,) * (6 - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[:4], spec[5]))


def merge_into_pages(
    arrays: Sequence[jax.Array],
    layout: pk.KVLayout,
    heads: int,
    ids: np.ndarray,
    canonical: jax.Array,
    kernel_kw: KernelOptions,
) -> jax.Array:
    """The staging a load scatters: the blocks' current pages with their real slots
    replaced by `canonical`, so padding slots keep the target's bytes."""
    current = pk.gather_blocks(arrays, ids, layout=layout, **kernel_kw)
    if canonical.sharding != current.sharding:
        canonical = jax.device_put(canonical, _slots_sharding(current, canonical))
    return pk.rpa_merge_canonical(current, canonical, heads, pk.rpa_shards(arrays[0]))


def _slots_sharding(current: jax.Array, canonical: jax.Array) -> jax.sharding.Sharding:
    sharding = current.sharding
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (current.ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[:4], spec[5]))
