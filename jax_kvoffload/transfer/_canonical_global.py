"""Canonical pages straight from global `jax.Array` caches sharded over a device mesh.

A JAX-native engine's cache is one global array per layer: every KV head and every token
of a block, whatever mesh holds it. Its page *is* the canonical page (vLLM's
`canonical_mapping.py`: all heads, all tokens, in the worker's encoding), so no relayout
is needed: `TransferEngine` (or `KVOffloader`) gathers the blocks from the global view
and copies the staging to host.
The bytes depend only on the values, never on the mesh, so a chunk written under one
mesh loads under any other; scatters keep each cache's sharding and write in place.
`check_global_caches` verifies that the arrays are global views.
"""

from __future__ import annotations

import pallas_kernels as pk
from jax_kvoffload.transfer._engine import GroupCaches
from jax_kvoffload.transfer._errors import TransferError

_HEAD_AXIS = {pk.PageFormat.NHD: -2, pk.PageFormat.HND: -3}


def check_global_caches(caches: GroupCaches, total_kv_heads: int) -> None:
    """Raises `TransferError` unless the arrays are global views: every KV head present
    (MLA and RAW pages have no head axis and are accepted as they are)."""
    if caches.layout.page_format is pk.PageFormat.RPA:
        _check_rpa(caches, total_kv_heads)
        return
    axis = _HEAD_AXIS.get(caches.layout.page_format)
    if axis is None:
        return
    for i, a in enumerate(caches.arrays):
        if a.shape[axis] != total_kv_heads:
            raise TransferError(
                f"array {i} has {a.shape[axis]} KV heads (shape {tuple(a.shape)}) but the "
                f"model has {total_kv_heads}: pass the global array (all heads), not a "
                "per-device shard, to get canonical pages from the global view"
            )


def _check_rpa(caches: GroupCaches, total_kv_heads: int) -> None:
    """RPA arrays hold every head in the formula's rows for the mesh that shards them;
    their global page is canonical only where no shard pads its slots."""
    for i, a in enumerate(caches.arrays):
        shards = pk.rpa_shards(a)
        try:
            pk.check_rpa_geometry(tuple(a.shape), a.dtype, total_kv_heads, shards)
            pads = pk.rpa_needs_merge(total_kv_heads, a.dtype, shards)
        except pk.LayoutError as e:
            raise TransferError(f"array {i}: {e}") from None
        if pads:
            raise TransferError(
                f"array {i}: an RPA cache of {total_kv_heads} KV heads in {a.dtype} over "
                f"{shards} shards pads each shard's slots, so its global page depends on the "
                "mesh; canonical pages for it are not supported here: drop canonical_layout"
            )
