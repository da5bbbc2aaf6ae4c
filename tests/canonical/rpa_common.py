"""Builders shared by the RPA offload tests (in-process and the mesh subprocess): a
config for ragged-paged-attention v3 caches and caches of special bit patterns."""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from jax_kvoffload.config import (
    CacheConfig,
    EngineConfig,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    build_offloading_config,
)
from tests.pallas_kernels.bitmodel import DTYPES, random_bits

NB, BS, HEAD_DIM, LAYERS = 12, 4, 64, 2
JAX_DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
JAX_DTYPES |= {"fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2, "int8": jnp.int8}
CONFIG_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
CONFIG_DTYPE |= {"fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "int8": "int8"}


def rpa_config(dtype: str, heads: int, *, tp: int = 1, canonical: bool = False, extra=None):
    spec = FullAttentionSpec(
        block_size=BS,
        num_kv_heads=max(1, heads // tp),
        head_size=HEAD_DIM,
        dtype=CONFIG_DTYPE[dtype],
    )
    names = tuple(f"l{i}" for i in range(LAYERS))
    engine = EngineConfig(
        model_config=ModelConfig(model="m", dtype=CONFIG_DTYPE[dtype], total_num_kv_heads=heads),
        cache_config=CacheConfig(block_size=BS),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=KVTransferConfig(
            kv_connector_extra_config={
                "cpu_bytes_to_use": 8 << 20,
                "blocks_per_chunk": 2,
                "cache_layout": "rpa",
                **({"canonical_layout": True} if canonical else {}),
                **(extra or {}),
            },
            engine_id="e",
        ),
    )
    kv = KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec),),
    )
    return build_offloading_config(engine, kv)


def rpa_bits(
    dtype: str, heads: int, shards: int, seed: int, noise_seed: int | None = None
) -> list[np.ndarray]:
    """Per layer, K and V of special bit patterns (from `seed`) packed into the RPA
    array for `shards` KV-head shards, every padding byte noise (from `noise_seed`), so
    untouched bytes show."""
    rng = np.random.default_rng(seed)
    noise_rng = np.random.default_rng(seed + 1000 if noise_seed is None else noise_seed)
    dt = DTYPES[dtype]
    out = []
    for _ in range(LAYERS):
        k = random_bits(rng, (NB, BS, heads, HEAD_DIM), dtype).view(dt)
        v = random_bits(rng, (NB, BS, heads, HEAD_DIM), dtype).view(dt)
        noise = lambda shape: random_bits(noise_rng, shape, dtype)  # noqa: E731
        out.append(pk.rpa_pack(k, v, shards=shards, pad_value=noise).view(k.dtype))
    return out


def kv_of(cache: np.ndarray, heads: int, shards: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V bits of an RPA array (no padding)."""
    k, v = pk.rpa_unpack(cache, heads, HEAD_DIM, shards=shards)
    u = np.dtype(f"u{cache.dtype.itemsize}")
    return k.view(u), v.view(u)


def as_bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def to_device(arrays, sharding=None) -> list[jax.Array]:
    return [jax.device_put(a, sharding) if sharding else jnp.asarray(a) for a in arrays]


def hashes(prefix: str, n: int) -> list[bytes]:
    out, parent = [], b""
    for i in range(n):
        parent = hashlib.sha256(parent + f"{prefix}:{i}".encode()).digest()
        out.append(parent)
    return out
