"""tpu-inference's side of the harness: config, runner, meshes and caches as theirs are.

Imported only after `_env.prepare()` (it imports jax and tpu-inference). Everything a
connector under test is handed comes from here, so that their connector and ours get
the same objects:

- `EngineConfig`: the part of vLLM's `VllmConfig` their connector reads
  (`model_config.model`, `cache_config.block_size`, `parallel_config` as a real
  `ParallelConfig`, `kv_transfer_config`), as their offload tests build it.
- `Runner`: a `TPUModelRunner` (theirs, or `_env`'s stand-in) with what the worker reads.
- `mesh(kind)`: "attn_dp" (attn_dp=2 x model=2: the worker takes its pure-JAX gather
  and scatter) or "model" (1 x 4: the load takes their Pallas TPU DMA kernel).
- `cache_shape(...)`: the ragged-paged-attention v3 shape, from their
  `get_kv_cache_shape_with_mesh` where it imports (torchax installed), else from the
  same formula; `rpa_formula` is that formula, per KV-head shard as theirs.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tpu_inference.runner.tpu_runner import TPUModelRunner
from vllm.config.parallel import ParallelConfig

DTYPES = {
    "bfloat16": jnp.bfloat16,
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "int8": jnp.int8,
    "float32": jnp.float32,
}
_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32}


class _Parallel(ParallelConfig):
    """A real `ParallelConfig` (their connector asserts the type) without vLLM's checks."""

    def __init__(self) -> None:
        self.pipeline_parallel_size = 1
        self.data_parallel_size = 1


@dataclasses.dataclass
class _Model:
    model: str = "harness-model"


@dataclasses.dataclass
class _Cache:
    block_size: int


@dataclasses.dataclass
class _Transfer:
    kv_connector: str = "TPUOffloadConnector"
    kv_connector_module_path: str = "tpu_inference.offload.tpu_offload_connector"
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = dataclasses.field(default_factory=dict)


class EngineConfig:
    """What their connector reads of a `VllmConfig`."""

    def __init__(self, block_size: int, connector: str, extra_config: dict | None = None):
        module, _, name = connector.partition(":")
        self.model_config = _Model()
        self.cache_config = _Cache(block_size)
        self.parallel_config = _Parallel()
        self.kv_transfer_config = _Transfer(name, module, "kv_both", dict(extra_config or {}))


class Runner(TPUModelRunner):
    """The runner contract of their worker: it reads `kv_caches`, `mesh`, `devices` and
    `get_kv_cache_layout()`, and assigns `kv_caches` after each gather and scatter."""

    def __init__(self, kv_caches: list[jax.Array], mesh: Mesh) -> None:  # no super(): theirs
        self.kv_caches = kv_caches  # needs a whole engine, as in their MockTPUModelRunner
        self.mesh = mesh
        self.devices = jax.devices()

    def get_kv_cache_layout(self) -> str:
        return "NHD"  # their kv_cache_manager's DEFAULT_KV_CACHE_LAYOUT


def load_connector(spec: str) -> type:
    """The class named by "module:Class"."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def mesh(kind: str) -> tuple[Mesh, P]:
    """A CPU mesh and the cache `PartitionSpec` tpu-inference uses on it."""
    devices = np.array(jax.devices()[:4])
    if kind == "attn_dp":  # ShardingAxisNameBase: BATCH covers attn_dp, KV_HEAD model
        return Mesh(devices.reshape(1, 2, 2), ("data", "attn_dp", "model")), P(
            ("data", "attn_dp"), None, "model"
        )
    if kind == "model":  # ShardingAxisName2D, their default: P("data", None, "model")
        return Mesh(devices.reshape(1, 4), ("data", "model")), P("data", None, "model")
    raise ValueError(f"mesh kind {kind!r}: use 'attn_dp' or 'model'")


def packing(dtype: Any) -> int:
    return 32 // (jnp.dtype(dtype).itemsize * 8)


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def rpa_formula(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: Any, shards: int
) -> tuple[int, ...]:
    """(num_blocks, block_size, shards * align(2 * H/shards, packing) / packing, packing,
    align(head_dim, 128)); head_dim 64 packs K and V in one 128-lane row instead:
    align(H/shards, packing) / packing rows of 128 (their kernel_hd64.py)."""
    per_shard, p = kv_heads // shards, packing(dtype)
    if head_dim == 64:
        return (num_blocks, block_size, shards * (_align(per_shard, p) // p), p, 128)
    rows = shards * (_align(2 * per_shard, p) // p)
    return (num_blocks, block_size, rows, p, _align(head_dim, 128))


def their_shape_function() -> Any | None:
    """`tpu_inference.runner.kv_cache.get_kv_cache_shape_with_mesh`, or None where it
    cannot be imported (it needs torchax)."""
    try:
        from tpu_inference.runner.kv_cache import get_kv_cache_shape_with_mesh
    except ImportError:
        return None
    return get_kv_cache_shape_with_mesh


def cache_shape(
    m: Mesh, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: Any
) -> tuple[int, ...]:
    theirs = their_shape_function()
    if theirs is not None:
        return tuple(theirs(m, num_blocks, block_size, kv_heads, head_dim, dtype))
    return rpa_formula(num_blocks, block_size, kv_heads, head_dim, dtype, m.shape["model"])


def random_bits(shape: tuple[int, ...], dtype: Any, seed: int) -> np.ndarray:
    """Every bit pattern of the dtype's width (NaN payloads included), as `dtype`."""
    word = _WORDS[jnp.dtype(dtype).itemsize]
    bits = np.random.default_rng(seed).integers(0, np.iinfo(word).max, shape, dtype=word)
    return bits.view(dtype)


def random_values(shape: tuple[int, ...], dtype: Any, seed: Any) -> np.ndarray:
    """What a model writes, roughly: finite normal numbers of both signs (no NaN, no
    -0.0, no subnormals), or every bit pattern for integer dtypes. Their own offload
    tests fill caches with `jax.random.uniform`, values of this kind."""
    if jnp.issubdtype(dtype, jnp.integer):
        return random_bits(shape, dtype, seed)
    rng = np.random.default_rng(seed)
    magnitude = rng.uniform(2.0**-4, 4.0, shape)
    return (np.where(rng.random(shape) < 0.5, -magnitude, magnitude)).astype(dtype)


PATTERNS = {"values": random_values, "bits": random_bits}


def bits(array: Any) -> np.ndarray:
    """The bytes of a (device or host) array as unsigned words, on the host."""
    host = np.asarray(array)
    return host.view(_WORDS[host.dtype.itemsize])


def make_caches(
    m: Mesh,
    spec: P,
    shapes: list[tuple[int, ...]],
    dtype: Any,
    seed: int,
    pattern: str = "values",
) -> tuple[list[jax.Array], list[np.ndarray]]:
    """One cache per shape filled with `PATTERNS[pattern]`, sharded as theirs; and a
    host copy of its bits."""
    sharding = NamedSharding(m, spec)
    fill = PATTERNS[pattern]
    host = [fill(s, dtype, seed * 1000 + i) for i, s in enumerate(shapes)]
    return [jax.device_put(h, sharding) for h in host], [bits(h).copy() for h in host]
