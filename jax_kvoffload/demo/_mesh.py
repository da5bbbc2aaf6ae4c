"""`demo --two-process --mesh-sizes W,R`: the engine's caches on a mesh of devices.

The writer runs on W devices, the reader on R (CPU devices: each role's process is
started with `--xla_force_host_platform_device_count`, `_two_process.py`). The caches
are global arrays whose KV heads are sharded over the mesh, so the offloader stores
canonical pages (`canonical_layout`, docs/canonical.md) that the reader's mesh loads.
With fewer KV heads than devices each head is held by `devices / kv_heads` devices (the
mesh is `kv_heads x replicas`, heads sharded over the first axis), as GQA replicates
heads over TP ranks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_kvoffload.demo._config import DemoConfigError, ScenarioConfig

__all__ = ["mesh_caches", "role_mesh_size"]


def role_mesh_size(cfg: ScenarioConfig, role: str | None) -> int | None:
    """The mesh size of `role`'s engine ("writer": the first of `mesh_sizes`, "reader":
    the second), or None when the demo runs on one device as before."""
    if cfg.mesh_sizes is None or role is None:
        return None
    return cfg.mesh_sizes[0 if role == "writer" else 1]


def _sharding(n: int, kv_heads: int) -> NamedSharding:
    devices = jax.devices()
    if len(devices) < n:
        raise DemoConfigError(
            f"--mesh-sizes: this engine needs {n} devices but {devices[0].platform} has "
            f"{len(devices)}; on CPU start it with XLA_FLAGS="
            f"--xla_force_host_platform_device_count={n} (--two-process does)"
        )
    shards = min(n, kv_heads)  # KV heads sharded over `shards` devices, each replicated
    grid = np.array(devices[:n]).reshape(shards, n // shards)
    return NamedSharding(Mesh(grid, ("tp", "replica")), P(None, None, None, "tp", None))


def mesh_caches(
    n: int, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int
) -> list[jax.Array]:
    """Zeroed global caches `[num_blocks, 2, block_size, kv_heads, head_dim]` uint32 with
    the KV heads sharded over a mesh of the first `n` devices."""
    sharding = _sharding(n, kv_heads)
    shape = (num_blocks, 2, block_size, kv_heads, head_dim)
    return [jax.device_put(jnp.zeros(shape, jnp.uint32), sharding) for _ in range(num_layers)]
