"""Compile the gather/scatter kernels for real accelerators without having one.

TPU: needs ``libtpu`` (the pin of jax's ``tpu`` extra, 0.0.42.* for jax 0.10.2); devices
come from ``jax.experimental.topologies.get_topology_desc("v5e:2x2", platform="tpu")``.
CUDA: needs ``jax-cuda13-plugin`` and ``jax-cuda13-pjrt`` (same version as jax) and
``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` (no driver or cuDNN here); devices are an H100
described by a ``GpuTargetConfigProto`` (sm_90a), so the compile emits real cubins; two
of them (``1x1x2``) for the mesh-sharded case.

Run in a separate venv that has the plugin (see docs/kernels.md):

    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/deviceless_compile.py tpu cuda
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk

# An H100 SXM from its public specs (the same fields the notes' experiment used).
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

# What compiles for each platform, from the registry (the oracle is not a kernel).
PLATFORM_BACKENDS = {
    p: tuple(b for b in pk.supported_backends(p) if b != "reference") for p in ("tpu", "cuda")
}

# (name, layout, cache shape, dtype, arrays, n): a vLLM flash-attn cache, an MLA cache.
CASES = [
    (
        "nhd_kv_first_bf16",
        pk.KVLayout.nhd(pk.KVStacking.FIRST),
        (2, 1024, 16, 8, 128),
        jnp.bfloat16,
        4,
        64,
    ),
    ("mla_fp8", pk.KVLayout.mla(), (1024, 64, 576), jnp.float8_e4m3fn, 4, 16),
]


def missing_plugin(platform: str) -> str | None:
    """Why the compile for ``platform`` cannot run here, or None when it can."""
    if platform == "tpu" and importlib.util.find_spec("libtpu") is None:
        return "libtpu is not installed (pip install 'libtpu==0.0.42.*' in a separate venv)"
    if platform == "cuda" and importlib.util.find_spec("jax_cuda13_plugin") is None:
        return (
            "jax-cuda13-plugin is not installed (pip install jax-cuda13-plugin==<jax version> "
            "jax-cuda13-pjrt==<jax version> in a separate venv)"
        )
    return None


def compile_only_devices(platform: str) -> list:
    from jax.experimental import topologies

    if platform == "tpu":
        return list(topologies.get_topology_desc("v5e:2x2", platform="tpu").devices)
    topo = topologies.get_topology_desc(
        "h100", "cuda", target_config=H100_TARGET_CONFIG, topology="1x1x2"
    )
    return list(topo.devices)


def compile_case(devices, backend, case):
    """Compiles gather and scatter of ``case`` with ``backend``; returns seconds taken."""
    _, layout, shape, dtype, num_arrays, n = case
    sharding = NamedSharding(jax.sharding.Mesh(np.array(devices[:1]), ("x",)), P())

    def sds(s, dt):
        return jax.ShapeDtypeStruct(s, dt, sharding=sharding)

    caches = [sds(shape, dtype)] * num_arrays
    ids = sds((n,), jnp.int32)
    staging = sds((n, num_arrays, *layout.page_shape(shape)), dtype)
    t0 = time.perf_counter()
    jax.jit(lambda c, i: pk.gather_blocks(c, i, layout=layout, backend=backend)).trace(
        caches, ids
    ).lower().compile()
    jax.jit(
        lambda c, i, s: pk.scatter_blocks(c, i, s, layout=layout, backend=backend),
        donate_argnums=0,
    ).trace(caches, ids, staging).lower().compile()
    return time.perf_counter() - t0


def compile_sharded(devices, backend, blocks=False):
    """Compiles gather and scatter of an NHD cache whose KV heads are sharded over every
    device (the shard-by-shard path: ``shard_map`` around the backend); returns seconds.
    ``blocks``: the blocks split over a second mesh axis as well (tpu-inference's
    attention-DP meshes: each device moves only the ids it owns).

    Traced through the API's jitted bodies with the plan the API would pick for concrete
    arrays of this sharding (inside an outer ``jax.jit`` the caches are tracers)."""
    from pallas_kernels.blocks import api
    from pallas_kernels.blocks.mesh import LocalPlan

    layout, shape, dtype, num_arrays, n = pk.KVLayout.nhd(), (1024, 16, 8, 128), jnp.bfloat16, 4, 64
    if blocks:
        grid = np.array(devices).reshape(2, -1)
        mesh = jax.sharding.Mesh(grid, ("dp", "tp"))
        cache_spec = P("dp", None, "tp", None)
        plan = LocalPlan(mesh, cache_spec, P(None, None, None, "tp", None), ("dp",))
    else:
        mesh = jax.sharding.Mesh(np.array(devices), ("tp",))
        plan = LocalPlan(mesh, P(None, None, "tp", None), P(None, None, None, "tp", None))
    kw = {"layout": layout, "backend": backend, "interpret": False}
    kw["config"] = pk.get_backend(backend).config()  # what the API resolves for None
    caches = tuple(
        jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, plan.cache_spec))
        for _ in range(num_arrays)
    )
    ids = jax.ShapeDtypeStruct((n,), jnp.int32, sharding=NamedSharding(mesh, P()))
    zero = jax.ShapeDtypeStruct((), jnp.uint32, sharding=NamedSharding(mesh, P()))
    staging = jax.ShapeDtypeStruct(
        (n, num_arrays, *layout.page_shape(shape)),
        dtype,
        sharding=NamedSharding(mesh, plan.staging_spec),
    )
    t0 = time.perf_counter()
    api._gather.trace(caches, ids, zero, local=plan, **kw).lower().compile()
    api._scatter_donating.trace(
        caches, ids, staging, zero, shardings=None, local=plan, **kw
    ).lower().compile()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("platforms", nargs="*", default=["tpu", "cuda"], choices=["tpu", "cuda"])
    args = parser.parse_args(argv)
    failed = 0
    for platform in args.platforms:
        reason = missing_plugin(platform)
        if reason:
            print(f"{platform}: SKIPPED: {reason}")
            continue
        devices = compile_only_devices(platform)
        print(f"{platform}: {devices[0].device_kind} (compile-only)")
        for backend in PLATFORM_BACKENDS[platform]:
            for case in CASES:
                try:
                    secs = compile_case(devices, backend, case)
                    print(f"  {backend:11s} {case[0]:20s} gather+scatter COMPILED {secs:5.1f}s")
                except Exception as exc:  # report every failure, then exit non-zero
                    failed += 1
                    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
                    print(f"  {backend:11s} {case[0]:20s} FAILED {type(exc).__name__}: {first}")
            for blocks in (False, True):
                if len(devices) < (4 if blocks else 2):
                    continue
                name = f"{'blocks+heads' if blocks else 'sharded'} over {len(devices)}"
                try:
                    secs = compile_sharded(devices, backend, blocks)
                    print(f"  {backend:11s} {name:20s} COMPILED {secs:5.1f}s")
                except Exception as exc:
                    failed += 1
                    print(f"  {backend:11s} {name} FAILED {type(exc).__name__}: {str(exc)[:200]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
