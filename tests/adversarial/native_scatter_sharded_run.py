"""Sharded cases for test_native_scatter_attack.py, run in a subprocess (it needs 8
simulated CPU devices). ``python native_scatter_sharded_run.py native|closed_bf16``
prints ``OK`` or the cases whose bytes differ from the model."""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk

# fp32 NaN payloads (quiet and signalling), -0.0, subnormals; their halves are bf16 ones
SPECIAL = np.array(
    [0x7FA00001, 0xFF800001, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F817F81, 0x00018001],
    np.uint32,
)


def bits(shape, dtype, rng):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize // 4
    words = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    pick = rng.random(n) < 0.5
    words[pick] = SPECIAL[rng.integers(0, len(SPECIAL), int(pick.sum()))]
    return words.view(dtype).reshape(shape)


def owned(host, sharding):
    # Made by a jit, not device_put from numpy: a CPU buffer that aliases host memory
    # cannot be donated, and the pointer check would blame the library.
    return jax.jit(lambda x: x, out_shardings=sharding)(jnp.asarray(host))


def expected(host, ids, staging, layer, axis):
    want = np.moveaxis(host.copy(), axis, 0)
    want[ids] = staging[:, layer]
    return np.moveaxis(want, 0, axis)


def nan_payloads(shape, dtype):
    # bf16 0x7F81 everywhere: a NaN with a payload, which an f32 round trip quiets
    return np.full(shape, 0x7F81, np.uint16).view(dtype)


def check(name, shape, dtype, mesh, spec, mode, rng, fill=bits, ids=(1, 6, 3)):
    layout = pk.named_layout(name)
    sharding = NamedSharding(mesh, spec)
    host = [fill(shape, dtype, rng) for _ in range(2)]
    ids = np.array(ids, np.int32)
    staging = fill((len(ids), 2, *layout.page_shape(shape)), dtype, rng)
    caches = [owned(h, sharding) for h in host]
    problems = []
    if mode == "direct":
        before = [[s.data.unsafe_buffer_pointer() for s in c.addressable_shards] for c in caches]
        out = pk.scatter_blocks(caches, ids, staging, layout=layout, backend="xla")
        after = [[s.data.unsafe_buffer_pointer() for s in o.addressable_shards] for o in out]
        if not all(c.is_deleted() for c in caches):
            problems.append("inputs not deleted")
        if after != before:
            problems.append("not updated in place")
        if not all(o.sharding.is_equivalent_to(sharding, o.ndim) for o in out):
            problems.append(f"sharding changed: {out[0].sharding}")
    elif mode == "closed":  # an outer jit closes over the concrete caches
        run = jax.jit(lambda s: pk.scatter_blocks(caches, ids, s, layout=layout, backend="xla"))
        out = run(jnp.asarray(staging))
    else:  # the caches are the outer jit's donated arguments
        run = jax.jit(
            lambda cs, s: pk.scatter_blocks(cs, ids, s, layout=layout, backend="xla"),
            donate_argnums=0,
        )
        out = run(caches, jnp.asarray(staging))
    for layer, o in enumerate(out):
        want = expected(host[layer], ids, staging, layer, layout.block_axis)
        got = np.asarray(o)
        if got.view(np.uint8).tobytes() != want.view(np.uint8).tobytes():
            diff = np.argwhere(got.view(np.uint8) != want.view(np.uint8))
            blocks = np.unique(diff[:, layout.block_axis]).tolist()
            problems.append(f"layer {layer}: {len(diff)} bytes differ in blocks {blocks}")
    if problems:
        return f"{name} {np.dtype(dtype).name} {spec} {dict(mesh.shape)} {mode}: {problems}"
    return None


def main() -> int:
    devices = np.array(jax.devices())
    heads = Mesh(devices[:4], ("model",))
    both = Mesh(devices.reshape(2, 4), ("dp", "model"))
    rng = np.random.default_rng(0)
    cases = []
    fill, ids = bits, (1, 6, 3)
    if sys.argv[1] == "native":
        for dt in (np.float32, np.int8):
            rpa = pk.rpa_cache_shape(8, 4, 8, 128, dt)
            cases += [
                ("nhd", (8, 4, 4, 8), dt, heads, P(None, None, "model")),  # 1 head each
                ("nhd", (8, 4, 4, 8), dt, both, P("dp")),  # blocks split, model replicated
                ("nhd_first", (2, 8, 4, 4, 8), dt, both, P(None, "dp", None, "model")),
                ("rpa", rpa, dt, both, P("dp", None, "model")),  # attention DP
                ("hnd_second", (8, 2, 4, 4, 8), dt, both, P()),  # replicated
            ]
        modes = ("direct", "closed", "donated")
    else:  # bf16 caches whose blocks are split, closed over by an outer jit
        cases = [("nhd", (8, 4, 4, 8), ml_dtypes.bfloat16, both, P("dp"))]
        modes = ("closed",)
        fill = lambda shape, dtype, rng: nan_payloads(shape, dtype)  # noqa: E731
        ids = (1,)  # the second device (blocks 4-7) owns none of them
    bad = [
        problem
        for case in cases
        for mode in modes
        if (problem := check(*case, mode, rng, fill, ids)) is not None
    ]
    print("\n".join(bad) if bad else "OK")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
