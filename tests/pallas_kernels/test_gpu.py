"""On a real NVIDIA GPU (``pytest -m gpu``, run by benchmarks/gpu_check.sh): every GPU
backend compiled for the device against the reference, bit for bit, and in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk

from .cases import LAYOUTS, Case, assert_same_bits, block_ids, make_caches, random_bits


def _gpu():
    try:
        return [d for d in jax.devices() if d.platform in ("gpu", "cuda")]
    except RuntimeError:
        return []


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU visible to jax"),
]

GPU_CASES = [
    Case("nhd_kv_first", "bf16", 4, 16, 128, 64, num_heads=8),
    Case("hnd_kv_second", "fp8_e4m3", 4, 16, 128, 7, num_heads=8),
    Case("mla", "bf16", 4, 64, 576, 64),
    Case("raw", "uint8", 1, 64, 1024, 7),
    Case("nhd", "fp32", 1, 64, 64, 1),
]


def _backends():
    major = int(str(getattr(_gpu()[0], "compute_capability", "0")).split(".")[0]) if _gpu() else 0
    names = ["triton", "xla"] + (["mosaic_gpu"] if major >= 9 else [])
    return [b for b in names if b in pk.available_backends()]


@pytest.mark.parametrize("backend", ["mosaic_gpu", "triton", "xla", "auto"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.id for c in GPU_CASES])
def test_gpu_kernel_matches_reference(backend, case):
    if backend != "auto" and backend not in _backends():
        pytest.skip(f"{backend} does not run on this GPU")
    layout = LAYOUTS[case.layout]
    caches = [jax.device_put(c, _gpu()[0]) for c in make_caches(case)]
    ids = block_ids(case.n)
    expected = pk.gather_blocks_reference(caches, jnp.asarray(ids), layout=layout)
    assert_same_bits(pk.gather_blocks(caches, ids, layout=layout, backend=backend), expected)

    update = random_bits(expected.shape, expected.dtype, seed=3)
    want = pk.scatter_blocks_reference(caches, jnp.asarray(ids), update, layout=layout)
    pointers = [c.unsafe_buffer_pointer() for c in caches]
    got = pk.scatter_blocks(caches, ids, update, layout=layout, backend=backend)
    for g, w in zip(got, want, strict=True):
        assert_same_bits(g, w)
    # Donated and aliased: the updated caches live in the buffers passed in.
    assert [g.unsafe_buffer_pointer() for g in got] == pointers
