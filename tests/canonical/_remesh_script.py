"""Run in a subprocess with 4 simulated CPU devices (see test_global_mesh.py).

A JAX engine with canonical pages changes its tensor-parallel size while it runs: the
`KVOffloader` stores a prefix from caches sharded over 2 devices, the engine moves to
4 devices (then 1), hands the offloader its new global arrays with `set_caches`, and
loads the prefix back into them: lookups still hit, the bytes are those stored, and each
cache keeps its new sharding. Prints "ok" on success; raises otherwise.
"""

import hashlib
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from jax_kvoffload import GroupCaches, KVOffloader
from tests.offloader.test_offloader import BS, NB, D, config

H = 4  # KV heads in total, 2 per rank of the TP=2 config


def on_mesh(arrays, n):
    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))
    return [jax.device_put(a, NamedSharding(mesh, P(None, None, "tp", None))) for a in arrays]


def main():
    cfg = config(extra={"canonical_layout": True}, heads=H, tp=2)
    assert cfg.canonical_layout and cfg.parallel.is_parallelism_agnostic, cfg
    rng = np.random.default_rng(0)
    full = [rng.integers(0, 2**16, (NB, BS, H, D), dtype=np.uint16) for _ in range(2)]
    hashes, parent = [], b""
    for i in range(6):
        parent = hashlib.sha256(parent + bytes([i])).digest()
        hashes.append(parent)
    caches = GroupCaches(on_mesh(full, 2), pk.KVLayout.nhd())
    with KVOffloader(cfg, caches, backend="xla", total_kv_heads=H) as off:
        assert off.wait([off.store(hashes, [1, 2, 3, 4, 5, 6])])[0].success
        for n, blocks in ((4, [9, 10, 11, 12, 13, 14]), (1, [0, 3, 5, 7, 8, 15])):
            zeros = on_mesh([np.zeros_like(a) for a in full], n)
            off.set_caches(zeros)  # the engine now runs on n devices
            assert off.lookup(hashes) == 6
            assert off.wait([off.load(hashes, blocks)])[0].success
            for got, want in zip(off.caches(), full, strict=True):
                assert got.sharding == zeros[0].sharding, (got.sharding, n)
                np.testing.assert_array_equal(np.asarray(got)[blocks], want[1:7])
    print("ok")


if __name__ == "__main__":
    main()
