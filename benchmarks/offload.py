"""Offload (device -> host chunks) and load (host chunks -> device) throughput.

For 16-token blocks of a `layers`-layer cache it times, in one run:
  engine    the TransferEngine: gather kernel per bucket + one device_put to pinned
            host, copied into the pre-allocated chunk rows (and the reverse for loads);
  per-block one transfer per block: a one-block gather + device_put (load: device_put +
            one-block scatter), i.e. what a naive per-block path does;
  one copy  one large device_put of the same bytes, already contiguous (`ceiling_*` in
            the CSV: the GPU target's reference; on CPU a store can beat it).
GiB/s counts the bytes moved once. Ratios engine/copy and engine/per-block are the
targets (GPU: >= 0.9 and >= 10x; CPU: >= 5x the per-block path). Prints one table per
direction (or `--json`), writes offload.csv and offload.png (when matplotlib imports)
under --out.

    python benchmarks/offload.py --quick            # < 1 min on 2 CPU cores
    python benchmarks/offload.py --layers 8 --blocks 64 256 --json
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
from jax_kvoffload.hostmem import HostChunkPool
from jax_kvoffload.transfer import GroupCaches, GroupTransfer, TransferEngine

FULL = {"blocks": [64, 256, 1024], "layers": [8, 32], "pages": [(8, 128), (2, 64)]}
QUICK = {"blocks": [64, 256], "layers": [8], "pages": [(8, 128), (2, 64)]}
BLOCK_SIZE = 16  # tokens per block; pages: (kv_heads, head_dim) -> 64 KiB or 8 KiB K+V in bf16


def measure(layers: int, blocks: int, page: tuple[int, int], repeats: int, backend: str) -> dict:
    num_blocks = 2 * blocks
    kv_heads, head_dim = page
    shape = (num_blocks, 2, BLOCK_SIZE, kv_heads, head_dim)  # K/V stacked second
    # uint16 storage for bf16 values: XLA:CPU upcasts bf16 scatters over the whole cache.
    arrays = [jnp.full(shape, k, jnp.uint16) for k in range(layers)]
    layout = pk.KVLayout.nhd(pk.KVStacking.SECOND)
    gc = GroupCaches(arrays, layout)
    pool = HostChunkPool(blocks, {0: gc.block_bytes}, 1)
    engine = TransferEngine({0: gc}, pool, backend=backend)  # default buckets
    ids = tuple(int(i) for i in np.random.default_rng(0).permutation(num_blocks)[:blocks])
    transfer = GroupTransfer(0, ids, tuple(range(blocks)))
    nbytes = blocks * gc.block_bytes
    job = iter(range(1, 10**9))

    def run(submit):
        j = next(job)
        submit(j, [transfer])
        (result,) = engine.wait([j])
        if not result.success:  # a failed job must not pass for a fast one
            raise RuntimeError(f"benchmark job failed: {result.error}")

    def engine_store():
        run(engine.submit_store)

    def engine_load():
        run(engine.submit_load)

    host = arrays[0].sharding.with_memory_kind("pinned_host")
    device = arrays[0].sharding

    def per_block_store():
        cur = engine.arrays(0)
        for k, b in enumerate(ids):
            one = pk.gather_blocks(cur, np.array([b], np.int32), layout=layout, backend=backend)
            data = np.asarray(jax.device_put(one, host))
            pool.write_blocks(0, [k], 0, data.reshape(1, -1).view(np.uint8))

    def per_block_load():
        cur = engine.arrays(0)
        row = np.empty((1, gc.block_bytes), np.uint8)
        for k, b in enumerate(ids):
            pool.read_blocks(0, [k], 0, 1, row)
            staged = row.view(np.uint16).reshape(1, layers, *layout.page_shape(shape))
            cur = pk.scatter_blocks(
                cur,
                np.array([b], np.int32),
                jax.device_put(staged, device),
                layout=layout,
                backend=backend,
            )
        jax.block_until_ready(cur)
        engine._caches[0].arrays = cur

    staging = jnp.zeros((blocks, gc.block_bytes // 2), jnp.uint16)
    host_staging = jax.block_until_ready(jax.device_put(staging, host))

    def ceiling_d2h():
        jax.block_until_ready(jax.device_put(staging, host))

    def ceiling_h2d():
        jax.block_until_ready(jax.device_put(host_staging, device))

    t = {
        "engine_store": _report.median(engine_store, repeats, warmup=True),
        "per_block_store": _report.median(per_block_store, 1, warmup=True),  # slow: 1 sample
        "ceiling_d2h": _report.median(ceiling_d2h, repeats, warmup=True),
        "engine_load": _report.median(engine_load, repeats, warmup=True),
        "per_block_load": _report.median(per_block_load, 1, warmup=True),
        "ceiling_h2d": _report.median(ceiling_h2d, repeats, warmup=True),
    }
    engine.close()
    return {
        "layers": layers,
        "page_kib": 2 * BLOCK_SIZE * kv_heads * head_dim * 2 // 1024,
        "blocks": blocks,
        "bytes": nbytes,
        **{f"{k}_s": v for k, v in t.items()},
        **{f"{k}_gibps": _report.gib_per_s(nbytes, v) for k, v in t.items()},
        "store_vs_ceiling": t["ceiling_d2h"] / t["engine_store"],
        "store_vs_per_block": t["per_block_store"] / t["engine_store"],
        "load_vs_ceiling": t["ceiling_h2d"] / t["engine_load"],
        "load_vs_per_block": t["per_block_load"] / t["engine_load"],
    }


def _columns(kind: str, ceiling: str) -> list[_report.Col]:
    Col = _report.Col
    return [
        Col("layers", "layers"),
        Col("page_kib", "page", "KiB"),
        Col("blocks", "blocks"),
        Col("mib", "job", "MiB", 0),
        Col(f"engine_{kind}_gibps", "engine", "GiB/s"),
        Col(f"per_block_{kind}_gibps", "per-block", "GiB/s"),
        Col(f"{ceiling}_gibps", "one copy", "GiB/s"),
        Col(f"{kind}_vs_ceiling", "engine/copy", "x"),
        Col(f"{kind}_vs_per_block", "engine/per-block", "x", 1),
    ]


def _case(r: dict) -> str:
    return f"{r['layers']} L x {r['page_kib']} KiB\n{r['blocks']} blocks\n{r['mib']:.0f} MiB job"


SERIES = (  # (row key, legend, color): the three paths of the table, in its order
    ("engine", "engine (TransferEngine)", "tab:blue"),
    ("per_block", "per-block transfers", "tab:red"),
    ("one_copy", "one copy of the same bytes, contiguous", "0.35"),
)


def plot(rows: list[dict], path: pathlib.Path, info: dict) -> None:
    """One question: how fast does each path move a job's bytes? GiB/s, as in the table.

    The one contiguous copy is a reference, not a ceiling: on CPU a store skips the host
    `device_put` (numpy reads the device array in place), so the engine can beat it."""
    plt = _report.pyplot()
    if plt is None:
        return
    x = np.arange(len(rows))
    width = 0.27
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.4 * len(rows) + 3), 4.4), sharey=True)
    for ax, kind, copy in ((axes[0], "store", "ceiling_d2h"), (axes[1], "load", "ceiling_h2d")):
        for i, (key, label, color) in enumerate(SERIES):
            column = copy if key == "one_copy" else f"{key}_{kind}"
            values = [r[f"{column}_gibps"] for r in rows]
            ax.bar(x + (i - 1) * width, values, width, label=label, color=color)
        ax.set_xticks(x, [_case(r) for r in rows], fontsize=7)
        arrow = "device -> host chunks" if kind == "store" else "host chunks -> device"
        ax.set_title(f"{kind} ({arrow})")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("GiB/s, bytes moved once (log scale)")
    every = [r[f"{c}_gibps"] for r in rows for c in _GIBPS]
    _report.log_axis(axes[0], min(every), max(every))
    handles, labels = axes[0].get_legend_handles_labels()
    fig.suptitle(
        f"offload and load: GiB/s of each path; measured {_report.measured_on(info)}",
        y=0.985,
        fontsize=10,
    )
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.945), ncol=3,
               frameon=False, fontsize=8)  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 0.89))
    _report.save(fig, path)


def replot(args) -> int:
    """`--replot FILE`: the PNG of a recorded run (its store and load tables), nothing
    measured."""
    info, tables = _report.read_recorded(args.replot.read_text(), "offload")
    by_title = dict(tables)
    store = _report.parse_rows(by_title[STORE_TITLE], _columns("store", "ceiling_d2h"))
    load = _report.parse_rows(by_title[LOAD_TITLE], _columns("load", "ceiling_h2d"))
    rows = [{**s, **lo} for s, lo in zip(store, load, strict=True)]
    plot(rows, args.out / "offload.png", info)
    return 0


_GIBPS = ("engine_store", "per_block_store", "ceiling_d2h", "engine_load", "per_block_load",
          "ceiling_h2d")  # fmt: skip
STORE_TITLE = "store: device -> host chunks"
LOAD_TITLE = "load: host chunks -> device"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sweep (< 1 min on CPU)")
    parser.add_argument("--repeats", type=_report.int_at_least(1), default=5)
    parser.add_argument("--backend", default="auto", choices=pk.BACKENDS)
    parser.add_argument(
        "--layers", nargs="+", type=_report.int_at_least(1), help="layer counts (sweep's)"
    )
    parser.add_argument(
        "--blocks", nargs="+", type=_report.int_at_least(1), help="blocks per job (sweep's)"
    )
    _report.add_output_args(parser, pathlib.Path(__file__).resolve().parent / "results")
    _report.add_replot_arg(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        return replot(args)
    why = _report.backend_problem(args.backend)
    if why:
        print(
            f"error: --backend {args.backend} cannot run on {jax.devices()[0].platform} ({why})",
            file=sys.stderr,
        )
        return 2
    sweep = dict(QUICK if args.quick else FULL)
    sweep["layers"] = args.layers or sweep["layers"]
    sweep["blocks"] = args.blocks or sweep["blocks"]
    cases = [
        (page, layers, blocks)
        for page in sweep["pages"]
        for layers in sweep["layers"]
        for blocks in sweep["blocks"]
    ]
    progress = _report.Progress(len(cases), quiet=args.quiet)
    rows = []
    for page, layers, blocks in cases:
        kib = 2 * BLOCK_SIZE * page[0] * page[1] * 2 // 1024
        progress.step(f"{layers} layers x {kib} KiB pages, {blocks} blocks")
        rows.append(measure(layers, blocks, page, args.repeats, args.backend))
    progress.finish()
    for r in rows:
        r["mib"] = r["bytes"] / _report.MIB
    _report.write_csv(args.out / "offload.csv", list(rows[0]), rows)
    plot(rows, args.out / "offload.png", _report.machine())
    note = f"median of {args.repeats} runs (per-block: 1 run), backend {args.backend}"
    _report.emit(
        "offload",
        args,
        [
            (STORE_TITLE, rows, _columns("store", "ceiling_d2h")),
            (LOAD_TITLE, rows, _columns("load", "ceiling_h2d")),
        ],
        rows,
        note=note,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
