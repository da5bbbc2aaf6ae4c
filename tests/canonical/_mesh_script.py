"""Run in a subprocess with 8 simulated CPU devices (see test_global_mesh.py).

For each model: the global cache, sharded over meshes of 1, 2, 4 and 8 devices, is
stored through a `TransferEngine` on the global arrays; every mesh must produce the same
host rows, equal to the rows that per-rank stores (TP=4, `CanonicalPoolView`) produce;
then a chunk written under one mesh is loaded under another. Prints "ok <n>" on success;
raises otherwise.
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_kvoffload.hostmem import HostChunkPool
from jax_kvoffload.transfer import GroupCaches, GroupTransfer, TransferEngine, check_global_caches
from tests.canonical.topology import FORMS, Model, Topology, reference, store

BLOCKS, CHUNKS = (5, 0, 3), (1, 0)
JOB = [GroupTransfer(0, BLOCKS, CHUNKS)]


def move(caches, pool, direction):
    """One store or load job through the engine; returns the arrays afterwards."""
    with TransferEngine({0: caches}, pool, backend="xla") as engine:
        getattr(engine, f"submit_{direction}")(1, JOB)
        (result,) = engine.wait([1])
        if not result.success:
            raise RuntimeError(result.error)
        return engine.arrays(0)


def sharded(model, arrays, n):
    layout, axes = FORMS[model.form]
    heads = model.total_heads if "h" in axes else 1
    tp = min(n, heads)  # more devices than heads: the rest replicate (GQA)
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(tp, n // tp), ("tp", "rep"))
    spec = [None] * len(axes)
    if "h" in axes:
        spec[axes.index("h")] = "tp"
    out = [jax.device_put(a, NamedSharding(mesh, P(*spec))) for a in arrays]
    return GroupCaches(out, layout)


def main():
    checked = 0
    models = [
        Model("packed-nhd", total_heads=8),
        Model("split-hnd", total_heads=8),
        Model("first-nhd", total_heads=8),
        Model("split-nhd", total_heads=2),
        Model("mla", total_heads=1, head_size=16),
    ]
    for model in models:
        ref = reference(model, Topology())
        per_rank, _ = store(model, Topology(tp=4), reference(model, Topology(tp=4)), BLOCKS, CHUNKS)
        want = per_rank.rows(0)
        pools = {}
        for n in (1, 2, 4, 8):
            caches = sharded(model, ref, n)
            check_global_caches(caches, model.total_heads)
            pool = HostChunkPool(2, {0: caches.block_bytes}, 2)
            move(caches, pool, "store")
            np.testing.assert_array_equal(pool.rows(0), want, err_msg=f"{model} mesh {n}")
            pools[n] = pool
        for src, dst in ((2, 8), (8, 1), (4, 2)):
            zeros = sharded(model, [np.zeros_like(a) for a in ref], dst)
            before = zeros.arrays[0].sharding
            out = move(zeros, pools[src], "load")
            assert out[0].sharding == before, (out[0].sharding, before)
            layout = zeros.layout
            for got, r in zip(out, ref, strict=True):
                g = np.take(np.asarray(got), BLOCKS, axis=layout.block_axis).view(np.uint16)
                w = np.take(r, BLOCKS, axis=layout.block_axis).view(np.uint16)
                np.testing.assert_array_equal(g, w, err_msg=f"{model} {src}->{dst}")
            checked += 1
    print("ok", checked)


if __name__ == "__main__":
    main()
