"""Mosaic GPU backend (Hopper and newer): TMA copies through shared memory.

Each CTA copies its run of blocks; every page is cut into TMA boxes of at most 256 rows
(the TMA box-dimension limit) and each box goes GMEM -> SMEM (TMA load, mbarrier) ->
GMEM (TMA store). ``stages`` SMEM slots let up to ``stages - 1`` stores drain while the
next load runs.

Gather is a ``plgpu.kernel``. Scatter is a ``pallas_call`` with ``input_output_aliases``:
in jax 0.10.2 the ``plgpu.kernel`` + ``jax.new_ref`` form fails to lower, and
the SMEM/barrier scratch is allocated with ``pl.run_scoped`` because scratch barriers in
``pallas_call`` break the GPU interpreter (both seen on 0.10.2). The GPU interpreter runs a single
CTA only, so interpret mode forces ``programs=1``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import jax
from jax import lax
from jax.experimental import pallas as pl

from .._compat import plgpu
from .fields import check_int, check_word_bytes

_TMA_MAX_BOX = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicGpuConfig:
    """Knobs of the Mosaic GPU kernels.

    Attributes:
      programs: CTAs launched; None means min(n, 132), one CTA per SM of an H100 SXM,
        each with its own TMA stream (a single CTA cannot saturate HBM).
      stages: SMEM slots per CTA, i.e. copies in flight: 4 keeps 3 stores draining while
        the next page loads.
      smem_budget_bytes: SMEM a CTA may use for its slots; 192 KiB leaves headroom under
        Hopper's 227 KiB opt-in limit (lowering checks 232448 bytes).
      word_bytes: width of the words moved (1, 2 or 4); None picks the widest.
    """

    programs: int | None = None
    stages: int = 4
    smem_budget_bytes: int = 192 * 1024
    word_bytes: int | None = None

    def __post_init__(self) -> None:
        check_int(self, "programs", none_ok=True)
        check_int(self, "stages")
        check_int(self, "smem_budget_bytes")
        check_word_bytes(self)


def _largest_divisor(value: int, cap: int) -> int:
    return max(d for d in range(1, min(value, cap) + 1) if value % d == 0)


def _boxes(w: int, itemsize: int, config: MosaicGpuConfig) -> tuple[int, int, int]:
    """(rows, lanes, rows_per_box) of the page view ``[rows, lanes]``."""
    lanes = 128 if w % 128 == 0 else _largest_divisor(w, _TMA_MAX_BOX)
    rows = w // lanes
    budget_rows = max(1, config.smem_budget_bytes // (config.stages * lanes * itemsize))
    return rows, lanes, _largest_divisor(rows, min(_TMA_MAX_BOX, budget_rows))


def _copy_pages(n, per, g, items, smem, bar, stages):
    """Copies ``items(i)`` (a list of (src_ref, dst_ref) boxes) for this CTA's blocks."""
    count = len(items(0))

    def step(j, carry):
        i = g * per + j

        @pl.when(i < n)
        def _():
            for k, (src, dst) in enumerate(items(i)):
                slot = lax.rem(j * count + k, stages)
                # At most stages-1 stores may still read SMEM, so `slot` is free.
                plgpu.wait_smem_to_gmem(stages - 1, wait_read_only=True)
                plgpu.copy_gmem_to_smem(src, smem.at[slot], bar.at[slot])
                plgpu.barrier_wait(bar.at[slot])
                plgpu.copy_smem_to_gmem(smem.at[slot], dst)

        return carry

    lax.fori_loop(0, per, step, 0)
    plgpu.wait_smem_to_gmem(0)


def _plan(words, n, config, interpret):
    outer, nb, w = words[0].shape
    rows, lanes, box = _boxes(w, words[0].dtype.itemsize, config)
    programs = 1 if interpret else min(n, config.programs or 132)
    return outer, nb, w, rows, lanes, box, programs, pl.cdiv(n, programs)


def _page_boxes(num_arrays, outer, rows, box):
    return [
        (a, o, pl.ds(r * box, box))
        for a in range(num_arrays)
        for o in range(outer)
        for r in range(rows // box)
    ]


def gather_words(
    words: Sequence[jax.Array], block_ids: jax.Array, *, config: MosaicGpuConfig, interpret=False
) -> jax.Array:
    """``words``: per array ``[outer, num_blocks, W]`` -> ``[n, L, outer, W]``."""
    n, num_arrays = block_ids.shape[0], len(words)
    outer, nb, w, rows, lanes, box, programs, per = _plan(words, n, config, interpret)
    dt = words[0].dtype
    boxes = _page_boxes(num_arrays, outer, rows, box)

    def body(ids_gmem, *refs):
        caches, out, smem, bar = refs[:num_arrays], refs[num_arrays], *refs[num_arrays + 1 :]

        def items(i):
            src = ids_gmem[i]
            return [(caches[a].at[o, src, rs], out.at[i, a, o, rs]) for a, o, rs in boxes]

        _copy_pages(n, per, lax.axis_index("b"), items, smem, bar, config.stages)

    kw = {"interpret": interpret} if interpret else {}
    out = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((n, num_arrays, outer, rows, lanes), dt),
        grid=(programs,),
        grid_names=("b",),
        scratch_types=[
            plgpu.SMEM((config.stages, box, lanes), dt),
            plgpu.Barrier(num_barriers=config.stages),
        ],
        **kw,
    )(block_ids, *[x.reshape(outer, nb, rows, lanes) for x in words])
    return out.reshape(n, num_arrays, outer, w)


def scatter_words(
    words: Sequence[jax.Array],
    block_ids: jax.Array,
    staging: jax.Array,
    *,
    config: MosaicGpuConfig,
    interpret=False,
) -> list[jax.Array]:
    """Writes ``staging[i, l]`` into page ``block_ids[i]`` of every array, in place."""
    n, num_arrays = block_ids.shape[0], len(words)
    outer, nb, w, rows, lanes, box, programs, per = _plan(words, n, config, interpret)
    dt = words[0].dtype
    boxes = _page_boxes(num_arrays, outer, rows, box)

    def body(ids_gmem, staging_gmem, *refs):
        caches_out = refs[num_arrays:]

        def items(i):
            dst = ids_gmem[i]
            return [
                (staging_gmem.at[i, a, o, rs], caches_out[a].at[o, dst, rs]) for a, o, rs in boxes
            ]

        pl.run_scoped(
            lambda smem, bar: _copy_pages(
                n, per, pl.program_id(0), items, smem, bar, config.stages
            ),
            plgpu.SMEM((config.stages, box, lanes), dt),
            plgpu.Barrier(num_barriers=config.stages),
        )

    gmem = pl.BlockSpec(memory_space=plgpu.GMEM)
    shape = jax.ShapeDtypeStruct((outer, nb, rows, lanes), dt)
    call = pl.pallas_call(
        body,
        out_shape=[shape] * num_arrays,
        grid=(programs,),
        in_specs=[gmem] * (2 + num_arrays),
        out_specs=[gmem] * num_arrays,
        # Operand 0 is the ids, 1 the staging buffer, 2.. the caches.
        input_output_aliases={2 + a: a for a in range(num_arrays)},
        compiler_params=plgpu.CompilerParams(),
        interpret=interpret,
        name="kv_scatter_blocks_mosaic_gpu",
    )
    with warnings.catch_warnings():
        # pallas_call on Mosaic GPU is deprecated in favour of plgpu.kernel, whose
        # mutable-ref form cannot scatter in place in jax 0.10.2 (see module docstring).
        warnings.filterwarnings("ignore", message=".*plgpu.kernel.*")
        out = call(
            block_ids,
            staging.reshape(n, num_arrays, outer, rows, lanes),
            *[x.reshape(outer, nb, rows, lanes) for x in words],
        )
    return [x.reshape(outer, nb, w) for x in out]
