"""Triton backend (NVIDIA GPUs before Hopper): pointer gather of page chunks.

Ids are an ordinary int32 operand (Triton has no scalar prefetch); every program copies
``blocks_per_program`` blocks for all arrays, ``chunk_words`` words per load/store.
Triton only lowers power-of-two array shapes (jax 0.10.2 refuses head_dim 100 when lowering), so a
chunk is the largest power of two dividing the page, capped by ``max_chunk_words``; any
page size (MLA's 576-wide latents, padded pages) then moves in whole chunks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
from jax.experimental import pallas as pl

from .._compat import pltriton
from .fields import check_int, check_power_of_two, check_word_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class TritonConfig:
    """Knobs of the Triton kernels.

    Attributes:
      blocks_per_program: blocks copied by one program. 1 by default: one page per
        program gives the GPU the most independent memory streams; raise it only when
        launch overhead shows for tiny pages.
      max_chunk_words: most words moved by one load/store. 4096 (16 KiB of u32) by
        default: large enough for full-bandwidth vector loads, small enough to stay in
        registers with ``num_warps`` warps.
      num_warps: warps per program, a power of two up to 32 (1024 threads); 4 saturates
        a page copy on A100-class GPUs.
      word_bytes: width of the words moved (1, 2 or 4); None picks the widest.
    """

    blocks_per_program: int = 1
    max_chunk_words: int = 4096
    num_warps: int = 4
    word_bytes: int | None = None

    def __post_init__(self) -> None:
        check_int(self, "blocks_per_program")
        check_int(self, "max_chunk_words")
        check_power_of_two(self, "num_warps", maximum=32)
        check_word_bytes(self)


def _chunk(words: int, cap: int) -> int:
    chunk = words & -words  # largest power of two dividing `words`
    while chunk > cap:
        chunk //= 2
    return chunk


def _for_each_block(n, per, body):
    p = pl.program_id(0)
    for j in range(per):
        i = p * per + j

        @pl.when(i < n)
        def _(i=i):
            body(i)


def _chunks(w, chunk, copy):
    def step(c, carry):
        copy(pl.ds(pl.multiple_of(c * chunk, chunk), chunk))
        return carry

    jax.lax.fori_loop(0, w // chunk, step, 0)


def _gather_kernel(ids_ref, *refs, n, per, num_arrays, outer, w, chunk):
    caches, out = refs[:num_arrays], refs[num_arrays]

    def block(i):
        src = ids_ref[i]
        for a in range(num_arrays):
            for o in range(outer):

                def copy(sl, a=a, o=o):
                    out[i, a, o, sl] = caches[a][o, src, sl]

                _chunks(w, chunk, copy)

    _for_each_block(n, per, block)


def _scatter_kernel(ids_ref, staging, *refs, n, per, num_arrays, outer, w, chunk):
    caches_out = refs[num_arrays : 2 * num_arrays]

    def block(i):
        dst = ids_ref[i]
        for a in range(num_arrays):
            for o in range(outer):

                def copy(sl, a=a, o=o):
                    caches_out[a][o, dst, sl] = staging[i, a, o, sl]

                _chunks(w, chunk, copy)

    _for_each_block(n, per, block)


def _params(config: TritonConfig):
    return pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1)


def _bind(body, words: Sequence[jax.Array], block_ids: jax.Array, config: TritonConfig):
    """`body` with the static sizes of this call, and its grid (blocks per program)."""
    outer, _, w = words[0].shape
    n = block_ids.shape[0]
    per = max(1, min(config.blocks_per_program, n))
    kernel = functools.partial(
        body,
        n=n,
        per=per,
        num_arrays=len(words),
        outer=outer,
        w=w,
        chunk=_chunk(w, config.max_chunk_words),
    )
    return kernel, (pl.cdiv(n, per),)


def gather_words(
    words: Sequence[jax.Array], block_ids: jax.Array, *, config: TritonConfig, interpret=False
) -> jax.Array:
    """``words``: per array ``[outer, num_blocks, W]`` -> ``[n, L, outer, W]``."""
    kernel, grid = _bind(_gather_kernel, words, block_ids, config)
    outer, _, w = words[0].shape
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((len(block_ids), len(words), outer, w), words[0].dtype),
        grid=grid,
        compiler_params=_params(config),
        interpret=interpret,
        name="kv_gather_blocks_triton",
    )(block_ids, *words)


def scatter_words(
    words: Sequence[jax.Array],
    block_ids: jax.Array,
    staging: jax.Array,
    *,
    config: TritonConfig,
    interpret=False,
) -> list[jax.Array]:
    """Writes ``staging[i, l]`` into page ``block_ids[i]`` of every array, in place."""
    kernel, grid = _bind(_scatter_kernel, words, block_ids, config)
    out = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in words],
        grid=grid,
        # Operand 0 is the ids, 1 the staging buffer, 2.. the caches.
        input_output_aliases={2 + a: a for a in range(len(words))},
        compiler_params=_params(config),
        interpret=interpret,
        name="kv_scatter_blocks_triton",
    )(block_ids, staging, *words)
    return list(out)
