"""Global caches sharded over a mesh vs one device: what a JAX-native engine pays.

A JAX engine's cache is one global array per layer, sharded over its devices along the KV
heads; its pages are the canonical pages (docs/canonical.md), so offloading them is the
canonical path with no relayout plan at all. This times `TransferEngine` store and load
jobs of the same global cache held by 1, 2, 4 (and 8) simulated CPU devices, each count
in its own subprocess (the device count is fixed when jax starts), alternating nothing:
one process per count, medians of `--repeats`. Reported: job time and its ratio to one
device. On CPU every "device" shares the same memory, so the ratio shows the cost of the
per-shard gathers and host copies, not of any interconnect.

Usage:
  python benchmarks/mesh.py              # 16 KV heads x 128, 16-token blocks, 8 layers
  python benchmarks/mesh.py --quick      # small sizes
  python benchmarks/mesh.py --out DIR    # CSV + PNG (default benchmarks/results/)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # _report, beside us
import _report  # noqa: E402

CHILD = r"""
import json, os, statistics, sys, time
n_dev, layers, blocks, heads, repeats = map(int, sys.argv[1:6])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n_dev}"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import pallas_kernels as pk
from jax_kvoffload.transfer import GroupCaches, GroupTransfer, HostChunkPool, TransferEngine

bs, dim, bpc = 16, 128, 16
mesh = Mesh(np.array(jax.devices()[:n_dev]), ("tp",))
sharding = NamedSharding(mesh, P(None, None, "tp", None))  # [blocks, tokens, heads, dim]
rng = np.random.default_rng(0)
arrays = [
    jax.device_put(rng.integers(0, 2**16, (2 * blocks, bs, heads, dim), dtype=np.uint16),
                   sharding)
    for _ in range(layers)
]
caches = GroupCaches(arrays, pk.KVLayout.nhd())
pool = HostChunkPool(blocks // bpc, {0: caches.block_bytes}, bpc, prefault=True)
job = [GroupTransfer(0, tuple(range(0, 2 * blocks, 2)), tuple(range(blocks // bpc)))]
out = {"devices": n_dev, "mib": blocks * caches.block_bytes / 2**20}
with TransferEngine({0: caches}, pool, backend="xla", max_bucket=blocks) as engine:
    ids = iter(range(1, 10**6))

    def run(direction):
        j = next(ids)
        getattr(engine, f"submit_{direction}")(j, job)
        (r,) = engine.wait([j])
        assert r.success, r.error

    run("store"), run("load")  # compile
    for d in ("store", "load"):
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            run(d)
            times.append(time.perf_counter() - t)
        out[d] = statistics.median(times)
print(json.dumps(out))
"""


def measure(n_dev, args):
    cmd = [sys.executable, "-c", CHILD, str(n_dev), str(args.layers), str(args.blocks)]
    cmd += [str(args.heads), str(args.repeats)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{n_dev} devices failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    args.layers, args.blocks, args.heads, args.repeats = (
        (4, 64, 8, 5) if args.quick else (8, 256, 16, 9)
    )
    counts = (1, 2, 4) if args.quick else (1, 2, 4, 8)
    print(
        f"# {datetime.date.today()} {platform.machine()} {os.cpu_count()} CPUs (simulated devices)"
    )
    rows = [measure(n, args) for n in counts]
    base = rows[0]
    for r in rows:
        r["store_over_1"] = r["store"] / base["store"]
        r["load_over_1"] = r["load"] / base["load"]
    cols = ["devices", "mib", "store", "load", "store_over_1", "load_over_1"]
    _report.report(pathlib.Path(args.out), "mesh", cols, rows, _plot)


def _plot(rows, path):
    plt = _report.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["devices"] for r in rows]
    for d, style in (("store", "o-"), ("load", "s--")):
        ax.plot(x, [1e3 * r[d] for r in rows], style, label=d)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices holding the global cache (KV heads sharded)")
    ax.set_ylabel(f"job time, ms ({rows[0]['mib']:.0f} MiB)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("global-array offload: one job, any mesh")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
