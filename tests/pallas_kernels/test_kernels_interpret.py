"""Every Pallas backend in its CPU interpreter against the reference, bit for bit.

Interpret mode is ~1000x slower than XLA, so each backend runs one covering set: every
layout, dtype, array count (1, 4), block size (16, 64), head dim (64, 128, 576) and
n (0, 1, 7, 64) appears at least once; ids are permuted, non-contiguous and include the
last block. Interpreters: the TPU one (models DMAs, semaphores and aliasing) for
``tpu``, the Mosaic GPU one (single CTA, TMA, barriers) for ``mosaic_gpu``, the HLO one
for ``triton``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

from .cases import DTYPES, LAYOUTS, Case, assert_same_bits, block_ids, make_caches, random_bits

COVER = [
    Case("nhd", "bf16", 1, 16, 64, 0),
    Case("nhd_kv_first", "fp16", 4, 16, 128, 7),
    Case("hnd", "fp32", 1, 64, 64, 64),
    Case("hnd_kv_second", "fp8_e4m3", 1, 16, 128, 1),
    Case("nhd_kv_separate", "fp8_e5m2", 4, 16, 64, 7),
    Case("mla", "bf16", 1, 16, 576, 7),
    Case("mla", "fp8_e4m3", 4, 64, 576, 64),
    Case("raw", "uint8", 4, 16, 64, 7),
    Case("raw", "int8", 1, 64, 128, 1),
    Case("nhd", "int8", 1, 64, 128, 64),
]

# Every value of every axis is covered (checked here so an edit cannot drop one).
assert {c.layout for c in COVER} == set(LAYOUTS)
assert {c.dtype for c in COVER} == set(DTYPES)
assert {c.n for c in COVER} == {0, 1, 7, 64}
assert {c.num_arrays for c in COVER} == {1, 4}
assert {c.block_size for c in COVER} == {16, 64}
assert {c.head_dim for c in COVER} == {64, 128, 576}

PALLAS_BACKENDS = [b.name for b in pk.list_backends() if b.interpreter and b.available]


def _skip_without_interpreter(backend):
    if not pk.get_backend(backend).can_interpret():
        pytest.skip(f"this jax has no interpreter for {backend}; it is lowering-tested")


@pytest.mark.parametrize("backend", PALLAS_BACKENDS)
@pytest.mark.parametrize("case", COVER, ids=[c.id for c in COVER])
def test_kernel_matches_reference(backend, case):
    _skip_without_interpreter(backend)
    layout = LAYOUTS[case.layout]
    caches = make_caches(case)
    ids = block_ids(case.n)

    staged = pk.gather_blocks(caches, ids, layout=layout, backend=backend, interpret=True)
    expected = pk.gather_blocks_reference(caches, jnp.asarray(ids), layout=layout)
    assert_same_bits(staged, expected)

    update = random_bits(staged.shape, staged.dtype, seed=7)
    want = pk.scatter_blocks_reference(caches, jnp.asarray(ids), update, layout=layout)
    got = pk.scatter_blocks(caches, ids, update, layout=layout, backend=backend, interpret=True)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert_same_bits(g, w)


@pytest.mark.slow  # every tuning knob in the interpreters: ~10 s on 2 idle cores
@pytest.mark.parametrize("backend", PALLAS_BACKENDS)
def test_kernel_tuning_knobs_keep_results(backend):
    """Several programs / small windows / narrow words move the same bits."""
    _skip_without_interpreter(backend)
    config = {
        "tpu": pk.TpuConfig(programs=3, blocks_in_flight=2, word_bytes=2),
        "triton": pk.TritonConfig(blocks_per_program=3, max_chunk_words=16, word_bytes=1),
        "mosaic_gpu": pk.MosaicGpuConfig(stages=2, smem_budget_bytes=2048, word_bytes=2),
    }[backend]
    case = Case("nhd_kv_first", "bf16", 4, 16, 64, 7)
    layout = LAYOUTS[case.layout]
    caches = make_caches(case)
    ids = block_ids(7)
    staged = pk.gather_blocks(
        caches, ids, layout=layout, backend=backend, config=config, interpret=True
    )
    assert_same_bits(staged, pk.gather_blocks_reference(caches, jnp.asarray(ids), layout=layout))
    update = random_bits(staged.shape, staged.dtype, seed=11)
    want = pk.scatter_blocks_reference(caches, jnp.asarray(ids), update, layout=layout)
    got = pk.scatter_blocks(
        caches, ids, update, layout=layout, backend=backend, config=config, interpret=True
    )
    for g, w in zip(got, want, strict=True):
        assert_same_bits(g, w)


def test_tpu_interpreter_rejects_an_out_of_range_id_inside_the_kernel():
    """Below the API checks, the TPU interpreter still refuses a bad DMA source (no clamp)."""
    if "tpu" not in pk.available_backends():
        pytest.skip("jax.experimental.pallas.tpu did not import")
    from jax.experimental.pallas import tpu as pltpu

    from pallas_kernels.blocks import tpu as tpu_backend

    words = [jnp.zeros((1, 8, 128), jnp.uint32)]
    ids = jnp.asarray(np.array([1, 8], np.int32))
    with pytest.raises(Exception, match=r"(?i)out.of.bounds|out of range"):
        tpu_backend.gather_words(
            words, ids, config=pk.TpuConfig(), interpret=pltpu.InterpretParams()
        ).block_until_ready()
    pltpu.reset_tpu_interpret_mode_state()
