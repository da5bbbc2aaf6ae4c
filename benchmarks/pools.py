"""The two host pools side by side: numpy rows (one host copy per store) vs pinned rows.

`HostChunkPool` pre-allocates its rows: a store's device-to-host copy lands in a
staging array that numpy then copies into the row. `PinnedRowPool` keeps the
`pinned_host` array `device_put` returned as the row (no host copy; one staging array
per chunk). For each case it times, alternating the pools, a store job (device -> host
rows) and a load job (host rows -> device) of the same blocks through a
`TransferEngine`, median of `--repeats`. On a CPU both are host memory and the copy
is all there is to save; the question the first GPU answers is whether the pinned rows
win there (tables, `pools.csv` under --out).

    python benchmarks/pools.py --quick          # seconds on 2 CPU cores
    python benchmarks/pools.py --blocks 256 1024 --chunk-blocks 16
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _report, beside us
import _report

import pallas_kernels as pk
from jax_kvoffload.hostmem import build_host_pool
from jax_kvoffload.transfer import GroupCaches, GroupTransfer, TransferEngine

POOLS = ("numpy", "pinned")  # host_pool kinds, built as the library builds them
FULL = {"blocks": [64, 256, 1024], "layers": 8, "page": (8, 128)}
QUICK = {"blocks": [32], "layers": 2, "page": (2, 64)}
BLOCK_SIZE = 16


def measure(blocks: int, layers: int, page: tuple[int, int], bpc: int, repeats: int) -> dict:
    kv_heads, head_dim = page
    shape = (2 * blocks, 2, BLOCK_SIZE, kv_heads, head_dim)
    layout = pk.KVLayout.nhd(pk.KVStacking.SECOND)
    num_chunks = -(-blocks // bpc)
    ids = tuple(int(i) for i in np.random.default_rng(0).permutation(2 * blocks)[:blocks])
    transfer = GroupTransfer(0, ids, tuple(range(num_chunks)))
    engines = {}
    for name in POOLS:
        arrays = [jnp.full(shape, k, jnp.uint16) for k in range(layers)]
        gc = GroupCaches(arrays, layout)
        pool, _ = build_host_pool(num_chunks, {0: gc.block_bytes}, bpc, kind=name)
        engines[name] = TransferEngine({0: gc}, pool)
    nbytes = blocks * GroupCaches([jnp.zeros(shape, jnp.uint16)], layout).block_bytes * layers
    job = iter(range(1, 10**9))

    def run(engine, submit):
        j = next(job)
        getattr(engine, submit)(j, [transfer])
        (result,) = engine.wait([j])
        if not result.success:  # a failed job must not pass for a fast one
            raise RuntimeError(f"benchmark job failed: {result.error}")

    samples: dict[str, list[float]] = {}
    for engine in engines.values():  # warm-up: compile every shape once
        run(engine, "submit_store")
        run(engine, "submit_load")
    for _ in range(repeats):  # alternate the pools: drift hits both alike
        for name, engine in engines.items():
            for kind in ("store", "load"):
                t = _report.median(lambda e=engine, k=kind: run(e, f"submit_{k}"), 1)
                samples.setdefault(f"{name}_{kind}", []).append(t)
    for engine in engines.values():
        engine.close()
    t = {k: float(np.median(v)) for k, v in samples.items()}
    row = {
        "blocks": blocks,
        "layers": layers,
        "chunk_blocks": bpc,
        "bytes": nbytes,
        "mib": nbytes / _report.MIB,
        **{f"{k}_s": v for k, v in t.items()},
        **{f"{k}_gibps": _report.gib_per_s(nbytes, v) for k, v in t.items()},
    }
    row["store_pinned_vs_numpy"] = t["numpy_store"] / t["pinned_store"]
    row["load_pinned_vs_numpy"] = t["numpy_load"] / t["pinned_load"]
    return row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small case (seconds on CPU)")
    parser.add_argument("--repeats", type=_report.int_at_least(1), default=5)
    parser.add_argument("--blocks", nargs="+", type=_report.int_at_least(1), help="blocks per job")
    parser.add_argument(
        "--chunk-blocks", type=_report.int_at_least(1), default=16, help="blocks per chunk (16)"
    )
    _report.add_output_args(parser, pathlib.Path(__file__).resolve().parent / "results")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sweep = dict(QUICK if args.quick else FULL)
    blocks = args.blocks or sweep["blocks"]
    progress = _report.Progress(len(blocks), quiet=args.quiet)
    rows = []
    for n in blocks:
        progress.step(f"{n} blocks, {args.chunk_blocks} per chunk")
        rows.append(measure(n, sweep["layers"], sweep["page"], args.chunk_blocks, args.repeats))
    progress.finish()
    _report.write_csv(args.out / "pools.csv", list(rows[0]), rows)
    Col = _report.Col
    cols = [
        Col("blocks", "blocks"),
        Col("mib", "job", "MiB", 1),
        Col("numpy_store_gibps", "numpy store", "GiB/s"),
        Col("pinned_store_gibps", "pinned store", "GiB/s"),
        Col("store_pinned_vs_numpy", "store pinned/numpy", "x"),
        Col("numpy_load_gibps", "numpy load", "GiB/s"),
        Col("pinned_load_gibps", "pinned load", "GiB/s"),
        Col("load_pinned_vs_numpy", "load pinned/numpy", "x"),
    ]
    note = (
        f"median of {args.repeats} alternating runs, {sweep['layers']} layers, "
        f"{args.chunk_blocks} blocks per chunk, on {jax.devices()[0].platform}"
    )
    _report.emit("pools", args, [("numpy rows vs pinned rows", rows, cols)], rows, note=note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
