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
  python benchmarks/mesh.py                   # 16 KV heads x 128, 16-token blocks, 8 layers
  python benchmarks/mesh.py --quick           # small sizes, under a minute
  python benchmarks/mesh.py --devices 1 2 --json
  python benchmarks/mesh.py --out DIR         # CSV + PNG (default benchmarks/results/)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
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
from jax_kvoffload.hostmem import HostChunkPool
from jax_kvoffload.transfer import GroupCaches, GroupTransfer, TransferEngine

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
out["jax"], out["device"] = jax.__version__, jax.devices()[0].device_kind
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


BLOCKS_PER_CHUNK = 16


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 layers, 64 blocks, 8 KV heads")
    ap.add_argument(
        "--devices", nargs="+", type=_report.int_at_least(1),
        help="simulated CPU device counts; the first is the baseline (1 2 4 8; quick: 1 2 4)",
    )  # fmt: skip
    ap.add_argument("--layers", type=_report.int_at_least(1), help="(8; quick: 4)")
    ap.add_argument(
        "--blocks", type=_report.int_at_least(BLOCKS_PER_CHUNK),
        help=f"blocks per job, a multiple of {BLOCKS_PER_CHUNK} (256; quick: 64)",
    )  # fmt: skip
    ap.add_argument("--heads", type=_report.int_at_least(1), help="KV heads (16; quick: 8)")
    ap.add_argument("--repeats", type=_report.int_at_least(1), help="(9; quick: 5)")
    _report.add_output_args(ap, ROOT / "benchmarks" / "results")
    _report.add_replot_arg(ap)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    layers, blocks, heads, repeats = (4, 64, 8, 5) if args.quick else (8, 256, 16, 9)
    args.layers = args.layers or layers
    args.blocks = args.blocks or blocks
    args.heads = args.heads or heads
    args.repeats = args.repeats or repeats
    args.devices = args.devices or ([1, 2, 4] if args.quick else [1, 2, 4, 8])
    if args.blocks % BLOCKS_PER_CHUNK:
        fix = -(-args.blocks // BLOCKS_PER_CHUNK) * BLOCKS_PER_CHUNK
        ap.error(f"--blocks {args.blocks}: must be a multiple of {BLOCKS_PER_CHUNK}; use {fix}")
    bad = [n for n in args.devices if args.heads % n]
    if bad:
        ap.error(
            f"--devices {bad[0]}: the {args.heads} KV heads (--heads) are sharded over the "
            "devices, so each count must divide them"
        )
    return args


COLUMNS = [
    _report.Col("devices", "devices"),
    _report.Col("mib", "job", "MiB", 0),
    _report.Col("store", "store", "ms", 1),
    _report.Col("load", "load", "ms", 1),
    _report.Col("store_over_1", "store vs first", "x"),
    _report.Col("load_over_1", "load vs first", "x"),
]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        return replot(args)
    progress = _report.Progress(len(args.devices), quiet=args.quiet)
    rows = []
    for n in args.devices:
        progress.step(f"{n} simulated devices (own process)")
        rows.append(measure(n, args))
    progress.finish()
    base = rows[0]
    for r in rows:
        r["store_over_1"] = r["store"] / base["store"]
        r["load_over_1"] = r["load"] / base["load"]
    info = {**_report.machine(), "jax": rows[0].pop("jax"), "device": rows[0].pop("device")}
    for r in rows[1:]:
        r.pop("jax"), r.pop("device")
    _report.write_csv(args.out / "mesh.csv", list(rows[0]), rows)
    _plot(rows, args.out / "mesh.png", info)
    note = (
        f"one global cache, {args.layers} layers x {2 * args.blocks} blocks x 16 tokens x "
        f"{args.heads} KV heads x 128 (uint16), heads sharded over the devices; jobs of "
        f"{args.blocks} blocks; medians of {args.repeats}; ratios against the first count "
        f"({base['devices']})"
    )
    _report.emit("mesh", args, [("", rows, COLUMNS)], rows, note=note, info=info)
    return 0


def _plot(rows, path, info):
    """One question: does a job cost more when the same cache is spread over more devices?

    In the table's unit: each job's time over the first count's (x); 1x = no cost."""
    plt = _report.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    x = [r["devices"] for r in rows]
    base = rows[0]["devices"]
    ratios = [r[f"{d}_over_1"] for r in rows for d in ("store", "load")]
    for d, style in (("store", "o-"), ("load", "s--")):
        values = [r[f"{d}_over_1"] for r in rows]
        ax.plot(x, values, style, label=f"{d} job")
        for n, v in list(zip(x, values, strict=True))[1:]:  # the first is 1× by definition
            ax.annotate(f"{v:.2f}×", (n, v), textcoords="offset points", fontsize=7,
                        xytext=(6, 5 if d == "store" else -11))  # fmt: skip
    ax.axhline(1, color="k", lw=1, label=f"as on {base} device{'s' * (base != 1)} (1×)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(n) for n in x])
    ax.set_xlabel("devices holding the global cache (KV heads sharded)")
    ax.set_ylabel(f"job time / time on {base} device{'s' * (base != 1)}")
    ax.set_ylim(0, max(1.5, max(ratios) * 1.15))
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}×"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(
        f"one job of {rows[0]['mib']:.0f} MiB on a mesh of simulated CPU devices:\n"
        f"time vs {base} device{'s' * (base != 1)}; measured {_report.measured_on(info)}",
        fontsize=9,
    )
    fig.tight_layout()
    _report.save(fig, path)


def replot(args) -> int:
    """`--replot FILE`: the PNG of a recorded run, nothing measured."""
    info, tables = _report.read_recorded(args.replot.read_text(), "mesh")
    _plot(_report.parse_rows(tables[0][1], COLUMNS), args.out / "mesh.png", info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
