"""Canonical pages straight from global `jax.Array` caches sharded over a device mesh.

A JAX-native engine's cache is one global array per layer: every KV head and every token
of a block, whatever mesh holds it. Its page *is* the canonical page (vLLM's
`canonical_mapping.py`: all heads, all tokens, in the worker's encoding), so no relayout
is needed: `TransferEngine` (or `KVOffloader`) gathers the blocks from the global view
and copies the staging to host.
The bytes depend only on the values, never on the mesh, so a chunk written under one
mesh loads under any other; scatters keep each cache's sharding and write in place.
`check_global_caches` verifies that the arrays are global views. RPA caches are the
exception: a shard may pad its slots, so their canonical pages drop the padding
(`canonical_group_caches`, `_rpa_pages.py`).
"""

from __future__ import annotations

import pallas_kernels as pk
from jax_kvoffload.transfer._engine import GroupCaches
from jax_kvoffload.transfer._errors import TransferError
from jax_kvoffload.transfer._rpa_pages import check_rpa_heads


def canonical_group_caches(caches: GroupCaches, total_kv_heads: int) -> GroupCaches:
    """`caches` as a group whose host pages are canonical: itself, or for RPA caches
    the same arrays with `canonical_kv_heads` set (per-shard padding dropped)."""
    check_global_caches(caches, total_kv_heads)
    if caches.layout.page_format is not pk.PageFormat.RPA:
        return caches
    return GroupCaches(caches.arrays, caches.layout, canonical_kv_heads=total_kv_heads)


_HEAD_AXIS = {pk.PageFormat.NHD: -2, pk.PageFormat.HND: -3}


def check_global_caches(caches: GroupCaches, total_kv_heads: int) -> None:
    """Raises `TransferError` unless the arrays are global views: every KV head present
    (MLA and RAW pages have no head axis and are accepted as they are)."""
    if caches.layout.page_format is pk.PageFormat.RPA:
        check_rpa_heads(caches.arrays, caches.layout, total_kv_heads, "canonical pages")
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
