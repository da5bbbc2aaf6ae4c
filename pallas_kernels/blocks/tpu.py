"""TPU backend: scalar-prefetched ids, HBM -> HBM async DMA, many copies in flight.

Caches and staging stay in HBM (``pl.ANY``): a page never round-trips through VMEM, so
no page size can overflow VMEM (blocked specs hit
``CompileTimeScopedVmemOom`` when compiled for v5e).
Each program starts the DMAs of its blocks for every array, keeping at most
``blocks_in_flight`` blocks outstanding, then waits for the rest. DMA semaphores count
bytes and every copy has the same size, so any wait retires exactly one copy.

In-place scatter writes the aliased cache only through DMA: the TPU interpreter showed
(jax 0.10.2) that an aliased *blocked* output is not pre-loaded from its input on TPU.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
from jax.experimental import pallas as pl

from .._compat import pltpu
from .fields import check_int, check_word_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class TpuConfig:
    """Knobs of the TPU DMA kernels.

    Attributes:
      programs: grid size; blocks are split in contiguous runs, one per program. 1 by
        default: the DMA engines do the work, and v5e/v6e have one TensorCore; use 2 on
        megacore chips (v4, v5p), where the grid axis is marked "parallel".
      blocks_in_flight: blocks whose DMAs may be outstanding per program before the
        oldest is waited for. 64 by default: enough to keep the DMA queues full for
        16-token pages (8-64 KiB) while bounding outstanding descriptors.
      word_bytes: width of the words moved (1, 2 or 4); None picks the widest dividing a
        page half (4 for almost every page: TPU memory is 32-bit word addressed).
      lanes: last-dimension size of the word view when it divides the page; 128 matches
        the TPU lane width so pages are whole HBM tiles.
    """

    programs: int = 1
    blocks_in_flight: int = 64
    word_bytes: int | None = None
    lanes: int = 128

    def __post_init__(self) -> None:
        for name in ("programs", "blocks_in_flight", "lanes"):
            check_int(self, name)
        check_word_bytes(self)


def _tile(words: int, lanes: int) -> tuple[int, int]:
    return (words // lanes, lanes) if words % lanes == 0 else (1, words)


def _run_blocks(n, programs, in_flight, start_block, wait_block):
    """Starts every block of this program, keeping ``in_flight`` outstanding; waits all."""
    per = pl.cdiv(n, programs)
    lo = pl.program_id(0) * per
    window = min(in_flight, per)

    def step(j, carry):
        @pl.when(jax.numpy.logical_and(j >= window, lo + j - window < n))
        def _():
            wait_block(lo + j - window)

        @pl.when(lo + j < n)
        def _():
            start_block(lo + j)

        return carry

    def drain(j, carry):
        @pl.when(lo + j < n)
        def _():
            wait_block(lo + j)

        return carry

    jax.lax.fori_loop(0, per, step, 0)
    jax.lax.fori_loop(per - window, per, drain, 0)


def _copy_blocks(ids_ref, copies, *, n, programs, in_flight):
    """Starts every copy of block i (``copies(i, block_id)``), windowed; waits by shape."""

    def start_block(i):
        for cp in copies(i, ids_ref[i]):
            cp.start()

    def wait_block(i):
        # A wait needs only the descriptor's shape and semaphore: block 0 stands in.
        for cp in copies(i, 0):
            cp.wait()

    _run_blocks(n, programs, in_flight, start_block, wait_block)


def _gather_kernel(ids_ref, *refs, n, num_arrays, outer, programs, in_flight):
    caches, out, sem = refs[:num_arrays], refs[num_arrays], refs[num_arrays + 1]

    def copies(i, block):
        return [
            pltpu.make_async_copy(caches[a].at[o, block], out.at[i, a, o], sem)
            for a in range(num_arrays)
            for o in range(outer)
        ]

    _copy_blocks(ids_ref, copies, n=n, programs=programs, in_flight=in_flight)


def _scatter_kernel(ids_ref, staging, *refs, n, num_arrays, outer, programs, in_flight):
    caches_out, sem = refs[num_arrays : 2 * num_arrays], refs[2 * num_arrays]

    def copies(i, block):
        return [
            pltpu.make_async_copy(staging.at[i, a, o], caches_out[a].at[o, block], sem)
            for a in range(num_arrays)
            for o in range(outer)
        ]

    _copy_blocks(ids_ref, copies, n=n, programs=programs, in_flight=in_flight)


def _compiler_params(programs: int):
    if programs == 1:
        return None
    return pltpu.CompilerParams(dimension_semantics=("parallel",))


def _bind(body, words: Sequence[jax.Array], block_ids: jax.Array, config: TpuConfig):
    """`body` with the static sizes of this call, and its program count."""
    n = block_ids.shape[0]
    programs = max(1, min(config.programs, n))
    kernel = functools.partial(
        body,
        n=n,
        num_arrays=len(words),
        outer=words[0].shape[0],
        programs=programs,
        in_flight=config.blocks_in_flight,
    )
    return kernel, programs


def gather_words(
    words: Sequence[jax.Array], block_ids: jax.Array, *, config: TpuConfig, interpret=False
) -> jax.Array:
    """``words``: per array ``[outer, num_blocks, W]`` -> ``[n, L, outer, W]``."""
    outer, nb, w = words[0].shape
    rows, lanes = _tile(w, config.lanes)
    n, num_arrays = block_ids.shape[0], len(words)
    kernel, programs = _bind(_gather_kernel, words, block_ids, config)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, num_arrays, outer, rows, lanes), words[0].dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(programs,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * num_arrays,
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        compiler_params=_compiler_params(programs),
        interpret=interpret,
        name="kv_gather_blocks_tpu",
    )(block_ids, *[x.reshape(outer, nb, rows, lanes) for x in words])
    return out.reshape(n, num_arrays, outer, w)


def scatter_words(
    words: Sequence[jax.Array],
    block_ids: jax.Array,
    staging: jax.Array,
    *,
    config: TpuConfig,
    interpret=False,
) -> list[jax.Array]:
    """Writes ``staging[i, l]`` into page ``block_ids[i]`` of every array, in place."""
    outer, nb, w = words[0].shape
    rows, lanes = _tile(w, config.lanes)
    n, num_arrays = block_ids.shape[0], len(words)
    kernel, programs = _bind(_scatter_kernel, words, block_ids, config)
    shape = jax.ShapeDtypeStruct((outer, nb, rows, lanes), words[0].dtype)
    out = pl.pallas_call(
        kernel,
        out_shape=[shape] * num_arrays,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(programs,),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * (1 + num_arrays),
            out_specs=[pl.BlockSpec(memory_space=pl.ANY)] * num_arrays,
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        # Operand 0 is the prefetched ids, 1 the staging buffer, 2.. the caches.
        input_output_aliases={2 + a: a for a in range(num_arrays)},
        compiler_params=_compiler_params(programs),
        interpret=interpret,
        name="kv_scatter_blocks_tpu",
    )(
        block_ids,
        staging.reshape(n, num_arrays, outer, rows, lanes),
        *[x.reshape(outer, nb, rows, lanes) for x in words],
    )
    return [x.reshape(outer, nb, w) for x in out]
