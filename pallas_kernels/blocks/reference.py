"""The oracle: plain ``jnp`` gather / scatter of whole pages, no word views, no kernels.

Values are bitcast element-wise to the same-width unsigned type first so nothing can
touch them (XLA:CPU converts bf16/fp8 scatters through f32, which may quiet NaN
payloads; an integer scatter cannot).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .layout import KVLayout

_SAME_WIDTH_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, _SAME_WIDTH_UINT[np.dtype(x.dtype).itemsize])


def gather_blocks_reference(
    caches: Sequence[jax.Array], block_ids: jax.Array, *, layout: KVLayout
) -> jax.Array:
    """``[n, len(caches), *page_shape]``: entry i holds every array's page of block_ids[i]."""
    dtype = caches[0].dtype
    pages = [
        jnp.moveaxis(jnp.take(_bits(c), block_ids, axis=layout.block_axis), layout.block_axis, 0)
        for c in caches
    ]
    return jax.lax.bitcast_convert_type(jnp.stack(pages, axis=1), dtype)


def scatter_blocks_reference(
    caches: Sequence[jax.Array],
    block_ids: jax.Array,
    staging: jax.Array,
    *,
    layout: KVLayout,
) -> list[jax.Array]:
    """Every cache with page block_ids[i] replaced by ``staging[i, layer]``."""
    axis = layout.block_axis
    index = (slice(None),) * axis + (block_ids,)
    out = []
    for layer, cache in enumerate(caches):
        pages = jnp.moveaxis(_bits(staging[:, layer]), 0, axis)
        out.append(jax.lax.bitcast_convert_type(_bits(cache).at[index].set(pages), cache.dtype))
    return out
