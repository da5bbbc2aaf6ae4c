"""Every GPU kernel lowers for ``cuda`` and every TPU kernel for ``tpu`` on the CPU-only
jaxlib (no plugin, nothing compiled): the expected custom call appears in StableHLO.

Shapes are realistic (H100-sized pages, 32 layers) because lowering is where Triton's
power-of-two rule and Mosaic GPU's shared-memory limit are enforced.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk

TARGETS = {
    "tpu": ("tpu", "tpu_custom_call"),
    "triton": ("cuda", "__gpu$xla.gpu.triton"),
    "mosaic_gpu": ("cuda", "mosaic_gpu_v2"),
}

SHAPES = [  # (layout, cache shape, dtype, arrays, n)
    (pk.KVLayout.nhd(pk.KVStacking.FIRST), (2, 512, 16, 8, 128), jnp.bfloat16, 4, 64),
    (pk.KVLayout.hnd(pk.KVStacking.SECOND), (512, 2, 8, 16, 128), jnp.float8_e4m3fn, 2, 7),
    (pk.KVLayout.mla(), (512, 64, 576), jnp.bfloat16, 32, 16),  # 72 KiB pages
    (pk.KVLayout.raw(), (512, 128 * 1024), jnp.uint8, 1, 5),  # 128 KiB pages
]


def _custom_calls(text: str) -> set[str]:
    return set(re.findall(r"custom_call @([\w.$-]+)", text))


def _lower(fn, args, platform):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("backend", list(TARGETS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0].page_format.name}-{s[1]}")
def test_gather_and_scatter_lower(backend, shape):
    if backend not in pk.available_backends():
        pytest.skip(f"{backend}'s Pallas module did not import on this jax")
    layout, cache_shape, dtype, num_arrays, n = shape
    platform, target = TARGETS[backend]
    caches = [jax.ShapeDtypeStruct(cache_shape, dtype)] * num_arrays
    ids = jax.ShapeDtypeStruct((n,), jnp.int32)
    staging = jax.ShapeDtypeStruct((n, num_arrays, *layout.page_shape(cache_shape)), dtype)

    def gather(c, i):
        return pk.gather_blocks(c, i, layout=layout, backend=backend)

    def scatter(c, i, s):
        return pk.scatter_blocks(c, i, s, layout=layout, backend=backend)

    assert target in _custom_calls(_lower(gather, (caches, ids), platform))
    text = _lower(scatter, (caches, ids, staging), platform)
    assert target in _custom_calls(text)
    # In place: the kernel's custom call aliases every cache output to its cache operand.
    assert "output_operand_aliases" in text
    assert text.count("output_tuple_indices") == num_arrays


def test_mosaic_gpu_rejects_a_box_that_overflows_shared_memory():
    """The smem budget is the knob lowering checks against Hopper's 227 KiB."""
    if "mosaic_gpu" not in pk.available_backends():
        pytest.skip("mosaic_gpu's Pallas module did not import on this jax")
    caches = [jax.ShapeDtypeStruct((64, 256 * 1024), jnp.uint8)]
    ids = jax.ShapeDtypeStruct((4,), jnp.int32)
    config = pk.MosaicGpuConfig(stages=4, smem_budget_bytes=1024 * 1024)

    def gather(c, i):
        return pk.gather_blocks(c, i, layout=pk.KVLayout.raw(), backend="mosaic_gpu", config=config)

    with pytest.raises(Exception, match="shared memory"):
        _lower(gather, (caches, ids), "cuda")
