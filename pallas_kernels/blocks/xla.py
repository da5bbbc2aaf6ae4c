"""XLA backend: ``jnp.take`` / ``.at[].set`` on integer word views; the CPU path and the
fallback wherever no Pallas backend applies.

Scatter runs on unsigned words, never on bf16/fp8 values: XLA:CPU upcasts a bf16/fp8
scatter to f32 over the whole operand (measured on jax 0.10.2: 100-750 ms for an 8-block update of a
1 GiB cache vs 0.01-0.12 ms for integer dtypes).

With words of the element's own width (the default) a scatter keeps each cache's shape
(``scatter_pages``): reshaping into a shape with a size-1 axis (the fp32 RPA cache's
packing axis, one KV head per device) makes XLA:CPU's layout assignment put that axis
elsewhere and copy the whole cache back (measured). Integer and fp32 caches are also kept
in their own type: no bitcast, so XLA updates the donated buffer where it lies, where a
bitcast of the operand makes XLA:CPU copy the cache into a new buffer and back (31 ms
for a 16-block update of a 64 MiB fp32 cache, 0.04 ms in its own type).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .fields import check_word_bytes
from .layout import KVLayout, as_bits, as_dtype, fenced, is_integer


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaConfig:
    """Knobs of the XLA backend.

    Attributes:
      word_bytes: width of the words moved (1, 2 or 4). None: gathers take the widest
        that divides a page half (XLA's gather cost grows with element count); scatters
        keep the cache's element width, since a bitcast of the operand makes XLA:CPU
        copy the whole cache instead of updating it in place.
    """

    word_bytes: int | None = None

    def __post_init__(self) -> None:
        check_word_bytes(self)


def gather_words(words: Sequence[jax.Array], block_ids: jax.Array) -> jax.Array:
    """``words``: per array ``[outer, num_blocks, W]`` -> ``[n, L, outer, W]``."""
    # promise_in_bounds: the API checked every id; "clip" or "fill" would hide a bad id.
    taken = [w.at[:, block_ids].get(mode="promise_in_bounds") for w in words]
    return jnp.stack([jnp.swapaxes(t, 0, 1) for t in taken], axis=1)


def scatter_words(
    words: Sequence[jax.Array], block_ids: jax.Array, staging: jax.Array
) -> list[jax.Array]:
    """Writes ``staging[i, l]`` (``[outer, W]``) into page ``block_ids[i]`` of array l.

    An id repeats only with the same row (a device of a split block axis sends the
    entries it does not own to an owned one, api._scatter_owned): whichever write lands,
    the page gets the same bytes, which is all ``unique_indices`` lets XLA assume away."""
    out = []
    for layer, w in enumerate(words):
        update = jnp.swapaxes(staging[:, layer], 0, 1)
        out.append(w.at[:, block_ids].set(update, unique_indices=True, mode="promise_in_bounds"))
    return out


def keeps_bits(dtype: np.dtype) -> bool:
    """True for element types loaded and stored bit for bit: integers and 4-byte floats
    (a bf16, fp16 or fp8 element is legalized through f32 on XLA:CPU, ``layout.fenced``).
    Tested on XLA:CPU (tests/pallas_kernels/test_bits_random.py); on GPUs and TPUs an
    fp32 load or store is a plain move too, not yet run there."""
    dt = np.dtype(dtype)
    return is_integer(dt) or dt.itemsize == 4


def scatter_pages(
    caches: Sequence[jax.Array],
    block_ids: jax.Array,
    staging: jax.Array,
    layout: KVLayout,
    fence: jax.Array | None,
) -> list[jax.Array]:
    """Writes ``staging[i, l]`` (one page) into page ``block_ids[i]`` of array l, in
    each cache's own shape: in its own type where that keeps bits (``keeps_bits``),
    else as same-width integers, fenced (``layout.fenced``; the API passes its fence).
    Like ``reference.scatter_pages`` but kept apart from it: the oracle shares no code
    with what it checks, and this one also skips bitcasts and promises unique ids."""
    dtype = caches[0].dtype
    own = keeps_bits(dtype)
    staged = as_dtype(staging, dtype) if own else fenced(as_bits(staging), fence)
    axis = layout.block_axis
    index = (slice(None),) * axis + (block_ids,)
    out = []
    for layer, cache in enumerate(caches):
        pages = jnp.moveaxis(staged[:, layer], 0, axis)
        target = cache if own else fenced(as_bits(cache), fence)
        done = target.at[index].set(pages, unique_indices=True, mode="promise_in_bounds")
        out.append(as_dtype(done, dtype))
    return out
