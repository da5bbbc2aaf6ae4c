"""Run by test_interpret_sharded.py in a subprocess (it needs its own CPU device count):

    python sharded_interpret_run.py BACKEND DEVICES HEADS SPEC

Gathers and scatters bf16 caches spread over DEVICES simulated CPU devices with
``interpret=True`` and checks every bit against numpy. SPEC: "heads" shards the KV heads
(the per-shard path), "blocks" the block axis, "replicated" none (the one-device path).
Prints "OK ..." and exits 0, or exits 1 naming the first difference.
"""

from __future__ import annotations

import os
import sys

backend, devices, heads, spec = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pallas_kernels as pk  # noqa: E402


def main() -> int:
    rng = np.random.default_rng(0)
    shape = (40, 16, heads, 64)  # [num_blocks, block_size, heads, head_dim], bf16
    mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))
    partition = {"heads": P(None, None, "x", None), "blocks": P("x"), "replicated": P()}[spec]
    sharding = NamedSharding(mesh, partition)
    layout = pk.KVLayout.nhd()
    raws = [rng.integers(0, 2**16, size=shape, dtype=np.uint16) for _ in range(2)]
    raws[0][0, 0, 0, :4] = [0x807F, 0x0001, 0x7F81, 0x8000]  # bits a float copy changes
    caches = [jax.device_put(r.view(ml_dtypes.bfloat16), sharding) for r in raws]
    ids = np.array([0, 39, 7, 0], np.int32)

    for _ in range(2):  # the Mosaic GPU interpreter failed at random: give it chances
        staged = pk.gather_blocks(caches, ids, layout=layout, backend=backend, interpret=True)
    want = np.stack([r[ids] for r in raws], axis=1)
    got = np.asarray(staged).view(np.uint16)
    if not np.array_equal(got, want):
        print(f"gather differs at {np.argwhere(got != want)[:3].tolist()}")
        return 1
    expected_sharding = pk.staging_sharding(caches, layout)
    if expected_sharding is not None and not staged.sharding.is_equivalent_to(
        expected_sharding, staged.ndim
    ):
        print(f"staging sharding {staged.sharding} != {expected_sharding}")
        return 1

    scatter_ids = np.array([3, 39, 0], np.int32)
    update = rng.integers(0, 2**16, size=(3, 2, 16, heads, 64), dtype=np.uint16)
    out = pk.scatter_blocks(
        caches,
        scatter_ids,
        jnp.asarray(update.view(ml_dtypes.bfloat16)),
        layout=layout,
        backend=backend,
        interpret=True,
    )
    for layer, (o, r) in enumerate(zip(out, raws, strict=True)):
        expect = r.copy()
        expect[scatter_ids] = update[:, layer]
        if not np.array_equal(np.asarray(o).view(np.uint16), expect):
            print(f"scatter differs in array {layer}")
            return 1
        if o.sharding != caches[layer].sharding:
            print(f"scatter changed the sharding: {o.sharding}")
            return 1
    shard_kib = caches[0].addressable_shards[0].data.nbytes // 1024
    print(f"OK {backend} on {devices} devices, {spec}, {shard_kib} KiB shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
