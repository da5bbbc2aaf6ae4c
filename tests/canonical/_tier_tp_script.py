"""One engine process of `test_tiers_across_tp.py`: store or load a prefix through tiers.

`python -m tests.canonical._tier_tp_script ROLE TP TIERS_JSON [CANONICAL]`

- ROLE `store`: a JAX engine whose caches are global arrays sharded over TP simulated
  CPU devices stores a seeded prefix; `close()` waits for the cascade into every tier.
- ROLE `load`: a fresh engine (empty host memory) on TP devices looks the prefix up
  (found in the tiers, promoted into the host) and loads it into other blocks.
- CANONICAL (default 1): `canonical_layout` in the extra config; 0 for a per-rank
  (direct) engine of the same model.

Prints one JSON line: the hit count, whether the loaded bytes equal the stored ones,
the per-tier promotions, the tier namespace and each cache's device count.
"""

import json
import os
import sys

ROLE, TP, TIERS = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
CANONICAL = len(sys.argv) < 5 or sys.argv[4] == "1"
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={max(TP, 1)}"

import hashlib  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from jax_kvoffload import GroupCaches, KVOffloader  # noqa: E402
from tests.offloader.test_offloader import BS, NB, D, config  # noqa: E402

H = 4  # KV heads in total: TP=1, 2 and 4 each hold whole heads
STORED = [1, 2, 3, 4, 5, 6]
LOADED = [9, 10, 11, 12, 13, 14]


def on_mesh(arrays, n):
    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))
    return [jax.device_put(a, NamedSharding(mesh, P(None, None, "tp", None))) for a in arrays]


def prefix():
    hashes, parent = [], b""
    for i in range(len(STORED)):
        parent = hashlib.sha256(parent + bytes([i])).digest()
        hashes.append(parent)
    return hashes


def main():
    extra = {"secondary_tiers": TIERS, **({"canonical_layout": True} if CANONICAL else {})}
    cfg = config(extra=extra, heads=H, tp=TP)
    assert cfg.canonical_layout == CANONICAL and cfg.parallel.is_parallelism_agnostic, cfg
    rng = np.random.default_rng(0)
    full = [rng.integers(0, 2**16, (NB, BS, H, D), dtype=np.uint16) for _ in range(2)]
    hashes = prefix()
    start = full if ROLE == "store" else [np.zeros_like(a) for a in full]
    caches = GroupCaches(on_mesh(start, TP), pk.KVLayout.nhd())
    kw = {"total_kv_heads": H} if CANONICAL else {}
    out = {"role": ROLE, "tp": TP, "canonical": CANONICAL}
    with KVOffloader(cfg, caches, backend="xla", **kw) as off:
        out["namespace"] = off.tier_namespace.hex()
        if ROLE == "store":
            out["stored"] = bool(off.wait([off.store(hashes, STORED)])[0].success)
        else:
            hit = off.lookup(hashes)
            out["hit"] = hit
            if hit:
                out["loaded"] = bool(off.wait([off.load(hashes[:hit], LOADED[:hit])])[0].success)
            got = [np.asarray(a) for a in off.caches()]
            out["devices"] = [len(a.sharding.device_set) for a in off.caches()]
            out["equal"] = hit == len(STORED) and all(
                np.array_equal(g[LOADED], w[STORED]) for g, w in zip(got, full, strict=True)
            )
    if ROLE == "store":
        out["cascaded"] = [t.cascaded for t in off.tier_stats]
    else:
        out["promoted"] = [t.promoted for t in off.tier_stats]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
