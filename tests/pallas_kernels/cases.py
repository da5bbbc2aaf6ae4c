"""Shared test data: tiny caches of random bits and exact (bitwise) comparisons."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from pallas_kernels import KVLayout, KVStacking

DTYPES = {
    "bf16": jnp.bfloat16,
    "fp16": jnp.float16,
    "fp32": jnp.float32,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2,
    "int8": jnp.int8,
    "uint8": jnp.uint8,
}

LAYOUTS = {
    "nhd": KVLayout.nhd(),
    "hnd": KVLayout.hnd(),
    "nhd_kv_first": KVLayout.nhd(KVStacking.FIRST),
    "hnd_kv_second": KVLayout.hnd(KVStacking.SECOND),
    "nhd_kv_separate": KVLayout.nhd(KVStacking.SEPARATE),
    "mla": KVLayout.mla(),
    "raw": KVLayout.raw(),
}

NUM_BLOCKS = 67  # > 64 so n=64 leaves some pages untouched; odd, so no power-of-2 luck


@dataclasses.dataclass(frozen=True)
class Case:
    layout: str
    dtype: str
    num_arrays: int
    block_size: int
    head_dim: int
    n: int
    num_heads: int = 1

    @property
    def id(self) -> str:
        return (
            f"{self.layout}-{self.dtype}-L{self.num_arrays}-bs{self.block_size}"
            f"-d{self.head_dim}-n{self.n}"
        )

    def shape(self) -> tuple[int, ...]:
        nb, bs, h, d = NUM_BLOCKS, self.block_size, self.num_heads, self.head_dim
        return {
            "nhd": (nb, bs, h, d),
            "hnd": (nb, h, bs, d),
            "nhd_kv_first": (2, nb, bs, h, d),
            "hnd_kv_second": (nb, 2, h, bs, d),
            "nhd_kv_separate": (nb, bs, h, d),
            "mla": (nb, bs, d),
            # A raw page: one block's bytes, or words for wider integer dtypes.
            "raw": (nb, bs * d),
        }[self.layout]

    def dtype_obj(self):
        return DTYPES[self.dtype]


def random_bits(shape, dtype, seed: int) -> jnp.ndarray:
    """Uniformly random bytes viewed as ``dtype``: NaN payloads, infs, denormals included."""
    dt = np.dtype(dtype)
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * dt.itemsize)
    return jnp.asarray(raw.astype(np.uint8).view(dt).reshape(shape))


def make_caches(case: Case, seed: int = 0) -> list[jnp.ndarray]:
    return [random_bits(case.shape(), case.dtype_obj(), seed + k) for k in range(case.num_arrays)]


def block_ids(n: int, num_blocks: int = NUM_BLOCKS, seed: int = 1) -> np.ndarray:
    """``n`` distinct ids, permuted and non-contiguous, always including the last block."""
    if n == 0:
        return np.zeros((0,), np.int32)
    rest = np.random.default_rng(seed).permutation(num_blocks - 1)[: n - 1]
    ids = np.concatenate([rest, [num_blocks - 1]])
    return np.random.default_rng(seed + 1).permutation(ids).astype(np.int32)


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def bits(x) -> np.ndarray:
    """The bit pattern of ``x``: comparing these is exact even for NaNs and -0.0."""
    a = np.asarray(x)
    return a.view(_UINT[a.dtype.itemsize])


def assert_same_bits(actual, expected) -> None:
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.dtype == e.dtype, (a.dtype, e.dtype)
    np.testing.assert_array_equal(bits(a), bits(e))
