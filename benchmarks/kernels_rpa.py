"""Gather / scatter on the ragged-paged-attention v3 layout against the NHD layout of the
same bytes: does the RPA layout cost anything? (issue 19: target >= 0.95x)

For each (dtype, KV heads, layers, blocks) it builds RPA caches
``[num_blocks, block_size, kv_rows, packing, 128]`` (tpu-inference's shape for one
device) and NHD caches ``[num_blocks, block_size, kv_rows * packing, 128]`` holding the
same bytes per block, and times ``gather_blocks`` and ``scatter_blocks`` of the same
random distinct blocks on both, alternating RPA and NHD calls so that machine noise
falls on both alike. The ratio is the median over call pairs of time(NHD) / time(RPA):
1x means the layout is free,
above 1x RPA is faster. GiB/s counts bytes read plus written (2 x the moved bytes).
"cache passes" counts, in the compiled program each call runs (caches donated), the steps
that write a whole cache's worth of bytes besides the scatter itself (bitcast copies,
fences, layout copies), summed over layers, RPA / NHD: a layout that costs a pass shows
here before it shows in the noise of the timings.
Prints a table (or ``--json``), writes ``kernels_rpa.csv`` and ``kernels_rpa.png``.

    python benchmarks/kernels_rpa.py --quick          # CPU, < 2 min on 2 busy cores
    python benchmarks/kernels_rpa.py --backends tpu   # a TPU host
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _report, beside us
import _report

import pallas_kernels as pk

DTYPES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn, "fp32": jnp.float32}
FULL = {"dtypes": ["bf16", "fp8", "fp32"], "heads": [2, 8], "layers": [4], "blocks": [16, 256]}
QUICK = {"dtypes": ["bf16", "fp8"], "heads": [8], "layers": [4], "blocks": [16, 128]}
BLOCK_SIZE = 16


def default_backends() -> list[str]:
    return [b for b in pk.supported_backends() if b != "reference"]


def _alternating(fns: dict[str, object], repeats: int) -> dict[str, float]:
    """Median seconds of each function, calls interleaved after one warm-up each, and
    ("ratio") the median of the paired ratios time(nhd) / time(rpa): adjacent calls
    share the machine's load, so the pairs cancel most of the noise of a busy host."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(repeats):
        order = list(fns) if i % 2 == 0 else list(fns)[::-1]  # neither always goes first
        for name in order:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[name]())
            samples[name].append(time.perf_counter() - t0)
    out = {k: statistics.median(v) for k, v in samples.items()}
    pairs = [n / r for n, r in zip(samples["nhd"], samples["rpa"], strict=True)]
    out["ratio"] = statistics.median(pairs)
    return out


_ELEMENT_BYTES = {"f32": 4, "u32": 4, "s32": 4, "bf16": 2, "f16": 2, "u16": 2, "s16": 2}
_STEP = re.compile(r"^\s*(?:ROOT )?%(\S+) = ([a-z0-9]+)\[([0-9,]*)\]\S* ([\w-]+)\(")


def cache_passes(text: str, cache_bytes: int) -> int:
    """Steps of a compiled program's entry computation whose result is one cache's size,
    the scatter itself (in place) and views (bitcast, tuple, parameter) left out."""
    entry = text[text.index("\nENTRY") :]
    count = 0
    for line in entry.splitlines()[1:]:
        m = _STEP.match(line)
        if m is None or m.group(4) in ("parameter", "bitcast", "tuple", "get-tuple-element"):
            continue
        if "scatter" in m.group(1):
            continue
        dims = [int(d) for d in m.group(3).split(",") if d]
        if _ELEMENT_BYTES.get(m.group(2), 1) * int(np.prod(dims)) == cache_bytes:
            count += 1
    return count


def passes(backend: str, layout, caches: list, ids: np.ndarray, staging) -> tuple[int, int]:
    """``cache_passes`` of the gather and of the (donating) scatter on these caches."""
    kw = {"layout": layout, "backend": backend}
    size = caches[0].nbytes

    def gather(c):
        return pk.gather_blocks(c, ids, **kw)

    def scatter(c, s):
        return pk.scatter_blocks(c, ids, s, **kw)

    texts = (
        jax.jit(gather).lower(caches).compile().as_text(),
        jax.jit(scatter, donate_argnums=0).lower(caches, staging).compile().as_text(),
    )
    return cache_passes(texts[0], size), cache_passes(texts[1], size)


def measure(backend: str, dtype: str, heads: int, layers: int, blocks: int, repeats: int):
    dt = DTYPES[dtype]
    num_blocks = 2 * blocks  # half the pages untouched, so ids are scattered
    rpa_shape = pk.rpa_cache_shape(num_blocks, BLOCK_SIZE, heads, 128, dt)
    nhd_shape = (num_blocks, BLOCK_SIZE, rpa_shape[2] * rpa_shape[3], 128)
    rng = np.random.default_rng(0)
    ids = rng.permutation(num_blocks)[:blocks].astype(np.int32)
    layouts = {"rpa": (pk.KVLayout.rpa(), rpa_shape), "nhd": (pk.KVLayout.nhd(), nhd_shape)}
    state, gathers, scatters, counts = {}, {}, {}, {}
    for name, (layout, shape) in layouts.items():
        itemsize = np.dtype(dt).itemsize
        raw = rng.integers(0, 256, (layers, int(np.prod(shape)) * itemsize), dtype=np.uint8)
        state[name] = [jnp.asarray(r.view(dt).reshape(shape)) for r in raw]
        kw = {"layout": layout, "backend": backend}
        staging = pk.gather_blocks(state[name], ids, **kw)

        def gather(name=name, kw=kw):
            return pk.gather_blocks(state[name], ids, **kw)

        def scatter(name=name, kw=kw, staging=staging):
            state[name] = pk.scatter_blocks(state[name], ids, staging, **kw)
            return state[name]

        gathers[name], scatters[name] = gather, scatter
        counts[name] = passes(backend, layout, state[name], ids, staging)
    tg = _alternating(gathers, repeats)
    ts = _alternating(scatters, repeats)
    page = int(np.prod(rpa_shape[1:])) * np.dtype(dt).itemsize
    return blocks * layers * page, page, tg, ts, counts


def run(args) -> list[dict]:
    grid = QUICK if args.quick else FULL
    cases = list(
        itertools.product(
            args.dtypes or grid["dtypes"],
            args.heads or grid["heads"],
            args.layers or grid["layers"],
            args.blocks or grid["blocks"],
        )
    )
    progress = _report.Progress(len(cases) * len(args.backends), quiet=args.quiet)
    rows = []
    for backend in args.backends:
        for dtype, heads, layers, blocks in cases:
            progress.step(f"{backend} {dtype} {heads} heads, {layers} layers, {blocks} blocks")
            case = (backend, dtype, heads, layers, blocks, args.repeats)
            moved, page, tg, ts, counts = measure(*case)
            rows.append(
                {
                    "backend": backend,
                    "dtype": dtype,
                    "heads": heads,
                    "layers": layers,
                    "blocks": blocks,
                    "page_kib": page / 1024,
                    "mib": moved / _report.MIB,
                    "rpa_gather_gibps": _report.gib_per_s(2 * moved, tg["rpa"]),
                    "nhd_gather_gibps": _report.gib_per_s(2 * moved, tg["nhd"]),
                    "rpa_scatter_gibps": _report.gib_per_s(2 * moved, ts["rpa"]),
                    "nhd_scatter_gibps": _report.gib_per_s(2 * moved, ts["nhd"]),
                    "gather_rpa_vs_nhd": tg["ratio"],
                    "scatter_rpa_vs_nhd": ts["ratio"],
                    "gather_passes": f"{counts['rpa'][0]}/{counts['nhd'][0]}",
                    "scatter_passes": f"{counts['rpa'][1]}/{counts['nhd'][1]}",
                }
            )
    progress.finish()
    return rows


Col = _report.Col
COLUMNS = [
    Col("backend", "backend", text=True),
    Col("dtype", "dtype", text=True),
    Col("heads", "heads"),
    Col("layers", "layers"),
    Col("blocks", "blocks"),
    Col("page_kib", "page", "KiB", digits=0),
    Col("mib", "moved", "MiB"),
    Col("rpa_gather_gibps", "gather rpa", "GiB/s"),
    Col("nhd_gather_gibps", "gather nhd", "GiB/s"),
    Col("rpa_scatter_gibps", "scatter rpa", "GiB/s"),
    Col("nhd_scatter_gibps", "scatter nhd", "GiB/s"),
    Col("gather_rpa_vs_nhd", "gather rpa/nhd", "x"),
    Col("scatter_rpa_vs_nhd", "scatter rpa/nhd", "x"),
    Col("gather_passes", "gather passes", "rpa/nhd", text=True),
    Col("scatter_passes", "scatter passes", "rpa/nhd", text=True),
]


def plot(rows: list[dict], path: pathlib.Path, info: dict) -> None:
    """One question: is a gather/scatter on the RPA layout as fast as on NHD? In the
    table's unit, time(NHD) / time(RPA) (x), the 0.95x target drawn."""
    plt = _report.pyplot()
    if plt is None:
        return
    labels = [f"{r['backend']} {r['dtype']}\n{r['heads']} H, {r['blocks']} blk" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(rows) + 2), 4.4))
    for i, op in enumerate(("gather", "scatter")):
        ratios = [r[f"{op}_rpa_vs_nhd"] for r in rows]
        at = x + (i - 0.5) * 0.38
        ax.bar(at, [v - 1 for v in ratios], 0.38, bottom=1, label=op)
        for xi, v in zip(at, ratios, strict=True):  # the value just past the bar's end
            up = v >= 1
            ax.text(xi, v + (0.004 if up else -0.004), f"{v:.2f}×", ha="center",
                    va="bottom" if up else "top", fontsize=7)  # fmt: skip
    values = [r[f"{op}_rpa_vs_nhd"] for r in rows for op in ("gather", "scatter")]
    ax.axhline(1, color="k", lw=1, label="as fast as NHD (1×)")
    ax.axhline(0.95, color="k", ls=":", lw=1, label="target (0.95×)")
    # The ratios sit near 1: a linear axis with a tick every 0.05× reads at a glance.
    low = min(0.9, np.floor(min(values) / 0.05) * 0.05 - 0.05)
    high = max(1.1, np.ceil(max(values) / 0.05) * 0.05 + 0.05)
    ticks = np.arange(low, high + 1e-9, 0.05)
    ax.set_ylim(low, high)
    ax.set_yticks(ticks, [f"{t:.2f}×" for t in ticks], fontsize=8)
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("time(NHD) / time(RPA)\n(above 1×: RPA faster)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=4, loc="upper center", frameon=False)
    ax.set_title(f"RPA vs NHD layout, same bytes; measured {_report.measured_on(info)}", fontsize=9)
    fig.tight_layout()
    _report.save(fig, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--backends", nargs="+", choices=[b for b in pk.BACKENDS if b != "auto"],
        help="kernel backends (default: those of this platform)",
    )  # fmt: skip
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES))
    p.add_argument("--heads", nargs="+", type=_report.int_at_least(1))
    p.add_argument("--layers", nargs="+", type=_report.int_at_least(1))
    p.add_argument("--blocks", nargs="+", type=_report.int_at_least(1))
    p.add_argument("--repeats", type=_report.int_at_least(1), default=15)
    p.add_argument("--quick", action="store_true", help="small grid; < 2 min on a 2-core CPU")
    _report.add_output_args(p, pathlib.Path(__file__).resolve().parent / "results")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.backends = args.backends or default_backends()
    for backend in args.backends:
        why = _report.backend_problem(backend)
        if why:
            print(f"error: --backends {backend}: {why}", file=sys.stderr)
            return 2
    rows = run(args)
    _report.write_csv(args.out / "kernels_rpa.csv", list(rows[0]), rows)
    plot(rows, args.out / "kernels_rpa.png", _report.machine())
    note = (
        f"backends {' '.join(args.backends)}; {args.repeats} RPA/NHD call pairs after a "
        "warm-up; GiB/s: median, bytes read + written; ratios: median of the pairs' "
        "time(NHD) / time(RPA) for the same bytes (target >= 0.95x)"
    )
    _report.emit("kernels_rpa", args, [("", rows, COLUMNS)], rows, note=note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
