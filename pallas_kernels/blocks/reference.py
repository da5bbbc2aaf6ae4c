"""The oracle: plain ``jnp`` gather / scatter of whole pages, no word views, no kernels.

Pages move as same-width integers, never as values. Inside the API's jit every copy is
also fenced (``layout.fenced``): XLA:CPU turns a bf16 element loaded and stored
unchanged into an f32 round trip, flushing subnormals and quieting NaN payloads, even
between integer bitcasts. Called eagerly, each operation is its own computation and no
bf16 element is ever copied as a value.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from .checks import check_block_ids, check_caches, check_staging
from .layout import KVLayout, as_bits, fenced


def gather_pages(
    caches: Sequence[jax.Array], block_ids: jax.Array, layout: KVLayout, fence: jax.Array | None
) -> jax.Array:
    """``gather_blocks_reference`` with the API's run-time fence (None: unfenced)."""
    axis = layout.block_axis
    pages = [jnp.moveaxis(jnp.take(as_bits(c), block_ids, axis=axis), axis, 0) for c in caches]
    out = fenced(jnp.stack(pages, axis=1), fence)
    return jax.lax.bitcast_convert_type(out, caches[0].dtype)


def scatter_pages(
    caches: Sequence[jax.Array],
    block_ids: jax.Array,
    staging: jax.Array,
    layout: KVLayout,
    fence: jax.Array | None,
) -> list[jax.Array]:
    """``scatter_blocks_reference`` with the API's run-time fence (None: unfenced)."""
    axis = layout.block_axis
    index = (slice(None),) * axis + (block_ids,)
    staged = fenced(as_bits(staging), fence)
    out = []
    for layer, cache in enumerate(caches):
        bits = fenced(as_bits(cache), fence)  # the API passes no fence for integer caches
        pages = jnp.moveaxis(staged[:, layer], 0, axis)
        out.append(jax.lax.bitcast_convert_type(bits.at[index].set(pages), cache.dtype))
    return out


def gather_blocks_reference(
    caches: Sequence[jax.Array], block_ids: jax.Array, *, layout: KVLayout
) -> jax.Array:
    """``[n, len(caches), *page_shape]``: entry i holds every array's page of block_ids[i].

    Inputs are checked as ``gather_blocks`` checks them."""
    caches = check_caches(caches, layout)
    block_ids = check_block_ids(block_ids, layout.num_blocks(caches[0].shape), unique=False)
    return gather_pages(caches, block_ids, layout, None)


def scatter_blocks_reference(
    caches: Sequence[jax.Array],
    block_ids: jax.Array,
    staging: jax.Array,
    *,
    layout: KVLayout,
) -> list[jax.Array]:
    """Every cache with page block_ids[i] replaced by ``staging[i, layer]`` (new arrays;
    nothing is donated). Inputs are checked as ``scatter_blocks`` checks them."""
    caches = check_caches(caches, layout)
    block_ids = check_block_ids(block_ids, layout.num_blocks(caches[0].shape), unique=True)
    page = layout.page_shape(tuple(caches[0].shape))
    check_staging(staging, (block_ids.shape[0], len(caches), *page), caches[0], layout)
    return scatter_pages(caches, block_ids, staging, layout, None)
