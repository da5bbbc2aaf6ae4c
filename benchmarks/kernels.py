"""Gather / scatter kernel bandwidth against the XLA path and a device-to-device copy.

For each (layers, page size, block count) it times ``gather_blocks`` and
``scatter_blocks`` of random distinct blocks out of raw-page caches
(``[num_blocks, page_bytes / 4]`` uint32, so the numbers are dtype-independent), and a
plain copy of the same bytes. GiB/s counts bytes read plus written (2 x the moved bytes).
Prints a table (or ``--json``), writes ``kernels.csv`` and ``kernels.png`` (when
matplotlib imports) under ``--out``.

    python benchmarks/kernels.py --quick                             # CPU: XLA path, < 1 min
    python benchmarks/kernels.py --backends mosaic_gpu triton xla    # GPU
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
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
    """The compiled backends this platform runs (the registry's answer; the reference
    backend is the oracle, not a contender)."""
    return [b for b in pk.supported_backends() if b != "reference"]


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
    cases = []
    for n_layers, page, n_blocks in itertools.product(layers, pages, blocks):
        gib = 2 * n_blocks * n_layers * page / 2**20 * 1.5  # caches + staging
        if gib > args.max_gib:
            print(
                f"skipped: {n_layers} layers x {page} KiB x {n_blocks} blocks needs {gib:.1f} GiB "
                f"(> --max-gib {args.max_gib:g})",
                file=sys.stderr,
            )
            continue
        cases.append((n_layers, page, n_blocks))
    progress = _report.Progress(len(cases), quiet=args.quiet)
    rows = []
    for n_layers, page, n_blocks in cases:
        progress.step(f"{n_layers} layers x {page} KiB pages, {n_blocks} blocks")
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
            rows.append(
                {
                    "backend": backend,
                    "layers": n_layers,
                    "page_kib": page,
                    "blocks": n_blocks,
                    "bytes": moved,
                    "mib": moved / _report.MIB,
                    "gather_s": tg,
                    "scatter_s": ts,
                    "copy_s": t_copy,
                    # read + written: 2 x the moved bytes, for the kernels and the copy alike
                    "gather_gibps": _report.gib_per_s(2 * moved, tg),
                    "scatter_gibps": _report.gib_per_s(2 * moved, ts),
                    "copy_gibps": _report.gib_per_s(2 * moved, t_copy),
                    "gather_vs_copy": t_copy / tg,
                    "scatter_vs_copy": t_copy / ts,
                    "gather_vs_xla": xg / tg if xg else float("nan"),
                    "scatter_vs_xla": xs / ts if xs else float("nan"),
                }
            )
    progress.finish()
    return rows


Col = _report.Col
COLUMNS = [
    Col("backend", "backend", text=True),
    Col("layers", "layers"),
    Col("page_kib", "page", "KiB"),
    Col("blocks", "blocks"),
    Col("mib", "moved", "MiB"),
    Col("gather_gibps", "gather", "GiB/s"),
    Col("scatter_gibps", "scatter", "GiB/s"),
    Col("copy_gibps", "copy", "GiB/s"),
    Col("gather_vs_copy", "gather/copy", "x"),
    Col("scatter_vs_copy", "scatter/copy", "x"),
    Col("gather_vs_xla", "gather vs xla", "x"),
    Col("scatter_vs_xla", "scatter vs xla", "x"),
]


def _case(r: dict) -> str:
    return f"{r['layers']} L, {r['page_kib']} KiB\n{r['blocks']} blocks\ncopy {r['copy_gibps']:.3g}"


def plot(rows: list[dict], path: pathlib.Path, info: dict) -> None:
    """One question: how close do gather and scatter come to a copy of the same bytes?

    In the table's unit, time(copy) / time(kernel) (x), on a log axis so that no case
    is clipped (sub-MiB cases sit in CPU caches and "beat" the copy several times over);
    the GPU target (0.85x) is drawn only on a plot measured on a GPU."""
    plt = _report.pyplot()
    if plt is None:
        return
    cases = sorted({(r["layers"], r["page_kib"], r["blocks"]) for r in rows})
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    by = {(r["backend"], r["layers"], r["page_kib"], r["blocks"]): r for r in rows}
    x = np.arange(len(cases))
    width = 0.8 / len(backends)
    fig, axes = plt.subplots(1, 2, figsize=(max(9, 1.5 * len(cases) + 3), 4.8), sharey=True)
    values = [r[f"{op}_vs_copy"] for r in rows for op in ("gather", "scatter")]
    low, high = min(values), max(values)
    device = str(info.get("device", "cpu")).lower()
    on_gpu = device != "cpu" and not device.startswith("tpu")  # the target is a GPU's
    for ax, op in zip(axes, ("gather", "scatter"), strict=True):
        for i, backend in enumerate(backends):
            ratios = [by[(backend, *c)][f"{op}_vs_copy"] for c in cases]
            at = x + (i - (len(backends) - 1) / 2) * width
            _report.ratio_bars(ax, at, ratios, width, label=backend)
        ax.axhline(1, color="k", lw=1, label="as fast as the copy (1×)")
        if on_gpu:
            ax.axhline(0.85, color="k", ls=":", lw=1, label="GPU target (0.85×)")
        first = {(r["layers"], r["page_kib"], r["blocks"]): r for r in rows}
        ax.set_xticks(x, [_case(first[c]) for c in cases], fontsize=7)
        _report.ratio_axis(ax, low, high)
        ax.set_title(f"{op}: copy time / {op} time")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("time(copy) / time(kernel), log scale\n(above 1×: faster than the copy)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.suptitle(
        f"gather and scatter vs a copy of the same bytes; measured {_report.measured_on(info)} "
        "(copy GiB/s under each case)",
        y=0.985,
        fontsize=10,
    )
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.945),
               ncol=len(labels), frameon=False, fontsize=8)  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 0.89))
    _report.save(fig, path)


def replot(args) -> int:
    """`--replot FILE`: the PNG of a recorded run, nothing measured."""
    info, tables = _report.read_recorded(args.replot.read_text(), "kernels")
    rows = _report.parse_rows(tables[0][1], COLUMNS)
    plot(rows, args.out / "kernels.png", info)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--backends", nargs="+", choices=[b for b in pk.BACKENDS if b != "auto"],
        help="kernel backends (default: those of this platform); xla is always added",
    )  # fmt: skip
    p.add_argument("--blocks", nargs="+", type=_report.int_at_least(1))
    p.add_argument("--page-kib", nargs="+", type=_report.int_at_least(1))
    p.add_argument("--layers", nargs="+", type=_report.int_at_least(1))
    p.add_argument("--repeats", type=_report.int_at_least(1), default=5)
    p.add_argument("--quick", action="store_true", help="small grid; < 1 min on a 2-core CPU")
    p.add_argument("--interpret", action="store_true", help="Pallas backends in interpret mode")
    p.add_argument(
        "--max-gib", type=_report.positive_float, default=None,
        help="skip configs needing more memory (default 2 on CPU, 48 on accelerators)",
    )  # fmt: skip
    _report.add_output_args(p, pathlib.Path(__file__).resolve().parent / "results")
    _report.add_replot_arg(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        return replot(args)
    args.backends = args.backends or default_backends()
    if "xla" not in args.backends:
        args.backends.append("xla")  # the baseline of every ratio
    if args.max_gib is None:
        args.max_gib = 2.0 if jax.devices()[0].platform == "cpu" else 48.0
    for backend in args.backends:
        why = _report.backend_problem(backend, args.interpret)
        if why:
            print(
                f"error: --backends {backend} cannot run on {jax.devices()[0].platform} "
                f"({why}); drop it, or add --interpret for a Pallas backend's interpreter",
                file=sys.stderr,
            )
            return 2
    rows = run(args)
    if not rows:
        print("error: every case was skipped by --max-gib; raise it", file=sys.stderr)
        return 2
    _report.write_csv(args.out / "kernels.csv", list(rows[0]), rows)
    plot(rows, args.out / "kernels.png", _report.machine())
    note = (
        f"backends {' '.join(args.backends)}; median of {args.repeats} after a warm-up; GiB/s "
        "counts bytes read + written; ratios are time(copy or xla) / time(kernel)"
    )
    _report.emit("kernels", args, [("", rows, COLUMNS)], rows, note=note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
