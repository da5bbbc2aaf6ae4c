"""Gather / scatter kernel bandwidth against the XLA path and a device-to-device copy.

For each (layers, page size, block count) it times ``gather_blocks`` and
``scatter_blocks`` of random distinct blocks out of raw-page caches
(``[num_blocks, page_bytes / 4]`` uint32, so the numbers are dtype-independent), and a
plain copy of the same bytes. GB/s counts bytes read plus written (2 x the moved bytes).
Writes ``kernels.csv`` and ``kernels.png`` (when matplotlib imports) under ``--out``.

    PYTHONPATH=. python benchmarks/kernels.py --quick          # CPU: XLA path, < 1 min
    PYTHONPATH=. python benchmarks/kernels.py --backends mosaic_gpu triton xla   # GPU
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import pathlib
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _report, beside us
import _report

import pallas_kernels as pk

FULL = {"blocks": [16, 64, 256, 1024, 4096], "page_kib": [4, 16, 64, 128], "layers": [1, 32]}
QUICK = {"blocks": [16, 256], "page_kib": [4, 64], "layers": [1, 32]}
LAYOUT = pk.KVLayout.raw()


def default_backends() -> list[str]:
    plat = jax.devices()[0].platform
    have = pk.available_backends()
    wanted = {"tpu": ["tpu", "xla"], "gpu": ["mosaic_gpu", "triton", "xla"]}.get(plat, ["xla"])
    return [b for b in wanted if b in have]


def _time(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` after one warm-up (compile) call."""
    return _report.median(lambda: jax.block_until_ready(fn()), repeats, warmup=True)


def measure(backend, layers, page_kib, blocks, *, repeats, interpret):
    words = page_kib * 1024 // 4
    num_blocks = blocks * 2  # half the pages untouched, so ids are scattered
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.permutation(num_blocks)[:blocks].astype(np.int32))
    caches = [jnp.full((num_blocks, words), k, jnp.uint32) for k in range(layers)]
    kw = {"layout": LAYOUT, "backend": backend, "interpret": interpret}
    gather = jax.jit(lambda c, i: pk.gather_blocks(c, i, **kw))
    staging = gather(caches, ids)
    t_gather = _time(lambda: gather(caches, ids), repeats)

    scatter = jax.jit(lambda c, i, s: pk.scatter_blocks(c, i, s, **kw), donate_argnums=0)
    state = {"caches": caches}

    def run_scatter():
        state["caches"] = scatter(state["caches"], ids, staging)
        return state["caches"]

    t_scatter = _time(run_scatter, repeats)
    moved = blocks * layers * page_kib * 1024
    return moved, t_gather, t_scatter


def measure_copy(moved: int, repeats: int) -> float:
    x = jnp.zeros((moved // 4,), jnp.uint32)
    copy = jax.jit(lambda a: a + jnp.uint32(1))  # forces a read and a full write
    return _time(lambda: copy(x), repeats)


def run(args) -> list[dict]:
    grid = QUICK if args.quick else FULL
    blocks = args.blocks or grid["blocks"]
    pages = args.page_kib or grid["page_kib"]
    layers = args.layers or grid["layers"]
    rows = []
    for n_layers, page, n_blocks in itertools.product(layers, pages, blocks):
        gib = 2 * n_blocks * n_layers * page / 2**20 * 1.5  # caches + staging
        if gib > args.max_gib:
            print(f"skip layers={n_layers} page={page}KiB blocks={n_blocks}: {gib:.1f} GiB")
            continue
        t_copy = None
        results = {}
        for backend in args.backends:
            moved, tg, ts = measure(
                backend, n_layers, page, n_blocks, repeats=args.repeats, interpret=args.interpret
            )
            results[backend] = (tg, ts)
            if t_copy is None:
                t_copy = measure_copy(moved, args.repeats)
        for backend, (tg, ts) in results.items():
            xg, xs = results.get("xla", (None, None))
            row = {
                "backend": backend,
                "layers": n_layers,
                "page_kib": page,
                "blocks": n_blocks,
                "mib": round(moved / 2**20, 3),
                "gather_gbps": 2 * moved / tg / 1e9,
                "scatter_gbps": 2 * moved / ts / 1e9,
                "copy_gbps": 2 * moved / t_copy / 1e9,
            }
            row["gather_vs_copy"] = row["gather_gbps"] / row["copy_gbps"]
            row["scatter_vs_copy"] = row["scatter_gbps"] / row["copy_gbps"]
            row["gather_vs_xla"] = xg / tg if xg else float("nan")
            row["scatter_vs_xla"] = xs / ts if xs else float("nan")
            rows.append(row)
            print_row(row)
    return rows


COLUMNS = [
    ("backend", "{:>10s}"),
    ("layers", "{:>6d}"),
    ("page_kib", "{:>8d}"),
    ("blocks", "{:>6d}"),
    ("mib", "{:>9.2f}"),
    ("gather_gbps", "{:>11.2f}"),
    ("scatter_gbps", "{:>12.2f}"),
    ("copy_gbps", "{:>9.2f}"),
    ("gather_vs_copy", "{:>14.2f}"),
    ("scatter_vs_copy", "{:>15.2f}"),
    ("gather_vs_xla", "{:>13.2f}"),
    ("scatter_vs_xla", "{:>14.2f}"),
]


def print_header() -> None:
    print(
        " ".join(
            f"{name:>{len(fmt.format(0) if 'd' in fmt else fmt.format(0.0))}s}"
            if name != "backend"
            else f"{name:>10s}"
            for name, fmt in COLUMNS
        )
    )


def print_row(row: dict) -> None:
    print(" ".join(fmt.format(row[name]) for name, fmt in COLUMNS), flush=True)


def write_outputs(rows: list[dict], out: pathlib.Path) -> None:
    _report.write_csv(out / "kernels.csv", [c for c, _ in COLUMNS], rows)
    plt = _report.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, op in zip(axes, ("gather", "scatter"), strict=True):
        for (backend, layers, page), group in itertools.groupby(
            sorted(rows, key=lambda r: (r["backend"], r["layers"], r["page_kib"], r["blocks"])),
            key=lambda r: (r["backend"], r["layers"], r["page_kib"]),
        ):
            g = list(group)
            ax.plot(
                [r["blocks"] for r in g],
                [r[f"{op}_gbps"] for r in g],
                marker="o",
                label=f"{backend} L={layers} {page} KiB",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("blocks")
        ax.set_title(f"{op} (GB/s, read + written)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    fig.tight_layout()
    fig.savefig(out / "kernels.png", dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", nargs="+", default=None)
    p.add_argument("--blocks", nargs="+", type=int)
    p.add_argument("--page-kib", nargs="+", type=int)
    p.add_argument("--layers", nargs="+", type=int)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="small grid; < 1 min on a 2-core CPU")
    p.add_argument("--interpret", action="store_true", help="Pallas backends in interpret mode")
    p.add_argument("--max-gib", type=float, default=None, help="skip configs above this")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    args = p.parse_args(argv)
    args.backends = args.backends or default_backends()
    if "xla" not in args.backends:
        args.backends.append("xla")  # the baseline of every ratio
    if args.max_gib is None:
        args.max_gib = 2.0 if jax.devices()[0].platform == "cpu" else 48.0
    print(
        f"{datetime.date.today()} {platform.node()} {jax.devices()[0].device_kind} "
        f"jax {jax.__version__} backends={args.backends}"
    )
    print_header()
    rows = run(args)
    write_outputs(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
