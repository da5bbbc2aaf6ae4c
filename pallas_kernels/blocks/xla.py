"""XLA backend: ``jnp.take`` / ``.at[].set`` on integer word views; the CPU path and the
fallback wherever no Pallas backend applies.

Scatter runs on unsigned words, never on bf16/fp8 values: XLA:CPU upcasts a bf16/fp8
scatter to f32 over the whole operand (measured on jax 0.10.2: 100-750 ms for an 8-block update of a
1 GiB cache vs 0.01-0.12 ms for integer dtypes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from .fields import check_word_bytes


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
