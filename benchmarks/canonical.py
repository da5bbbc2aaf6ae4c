"""Canonical vs direct offload: what the canonical relayout costs against the transfer.

For each case (page encoding x TP of the storing rank), rank 0 of the TP group stores and
loads `--blocks` blocks of `--layers` layers through `TransferEngine`, once into a plain
`HostChunkPool` (direct) and once through `CanonicalPoolView` (canonical: the relayout into
shared canonical rows, writer rotation included). The two engines run alternately, repeat
after repeat, so machine noise hits both alike. The relayout is not an extra pass: it *is*
the host copy between staging and pool rows that the direct path makes as a plain row copy,
so the cost of the canonical path is `canonical_s / direct_s - 1` of the whole job; the
host copies alone (`relayout_s` vs `plain_copy_s`) show where it comes from. On CPU the
"transfer" is a host memcpy, the worst case for the ratio; on an accelerator the job also
pays the D2H/H2D copy.

Usage:
  python benchmarks/canonical.py                  # 16-token blocks, 16 KV heads x 128, bf16
  python benchmarks/canonical.py --quick          # small sizes, under a minute
  python benchmarks/canonical.py --tp 2 4 --forms split-nhd --json
  python benchmarks/canonical.py --out DIR        # CSV + PNG (default benchmarks/results/)
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _report, beside us
import _report
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from jax_kvoffload.config import FullAttentionSpec
from jax_kvoffload.config.canonical import KVTensorView, RankContext, layer_mapping
from jax_kvoffload.hostmem import HostChunkPool
from jax_kvoffload.hostmem.internals import copy_threads
from jax_kvoffload.transfer import (
    CanonicalPoolView,
    GroupCaches,
    GroupTransfer,
    TransferEngine,
    plan_for_group,
)

FORMS = {
    "packed-nhd": (pk.KVLayout.nhd(), "packed", "nhd"),
    "split-nhd": (pk.KVLayout.nhd(pk.KVStacking.SECOND), "split", "nhd"),
    "split-hnd": (pk.KVLayout.hnd(pk.KVStacking.SECOND), "split", "hnd"),
}


def _shape(form, nb, bs, heads, hs):
    return {
        "packed-nhd": (nb, bs, heads, 2 * hs),
        "split-nhd": (nb, 2, bs, heads, hs),
        "split-hnd": (nb, 2, heads, bs, hs),
    }[form]


def run_case(form, tp, args):
    layout, kind, order = FORMS[form]
    heads = args.total_heads // tp
    bs, hs, nb, n = args.block_size, args.head_size, args.blocks * 2, args.blocks
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=hs, dtype="bfloat16")
    make = KVTensorView.split if kind == "split" else KVTensorView.packed
    view = make(nb, heads, bs, hs, 2, order)
    mapping = layer_mapping(spec, view, nb, RankContext(tp, 1, 1, 1, args.total_heads, 0))
    rng = np.random.default_rng(0)
    shape = _shape(form, nb, bs, heads, hs)
    arrays = [
        # bf16 bits held as uint16, as CPU caches should be: XLA:CPU widens a bf16
        # scatter over the whole cache (docs/kernels.md), which would swamp the loads.
        jnp.asarray(rng.integers(0, 2**16, shape, dtype=np.uint16))
        for _ in range(args.layers)
    ]
    bpc = 16
    chunks = tuple(range(n // bpc))
    plan = plan_for_group([mapping] * args.layers, [mapping.local_page_size_bytes] * args.layers)
    direct_pool = HostChunkPool(len(chunks), {0: plan.local_block_bytes}, bpc, prefault=True)
    shared = HostChunkPool(len(chunks), {0: plan.canonical_block_bytes}, bpc, prefault=True)
    ids = tuple(range(0, nb, 2))[:n]
    job = [GroupTransfer(0, ids, chunks)]
    pools = {"direct": direct_pool, "canonical": CanonicalPoolView(shared, {0: plan})}
    engines = {
        name: TransferEngine(
            {0: GroupCaches([jnp.array(a, copy=True) for a in arrays], layout)},
            pool,
            backend="xla",
            max_bucket=n,
        )
        for name, pool in pools.items()
    }
    counter = iter(range(1, 10**6))

    def do(name, direction):
        eng, j = engines[name], next(counter)
        (eng.submit_store if direction == "store" else eng.submit_load)(j, job)
        (r,) = eng.wait([j])
        assert r.success, r.error

    times = {(name, d): [] for name in engines for d in ("store", "load")}
    try:
        for name in engines:  # compile
            do(name, "store"), do(name, "load")
        for i in range(args.repeats):  # alternate (and swap the order): noise hits both
            for d in ("store", "load"):
                for name in list(engines)[:: 1 if i % 2 else -1]:
                    t = time.perf_counter()
                    do(name, d)
                    times[name, d].append(time.perf_counter() - t)
    finally:
        for eng in engines.values():
            eng.close()
    out = {
        name: {d: statistics.median(times[name, d]) for d in ("store", "load")} for name in engines
    }
    rows = np.random.default_rng(1).integers(0, 256, (n, plan.local_block_bytes), np.uint8)
    flat = shared.rows(0).reshape(-1, plan.canonical_block_bytes)
    slots = np.arange(n)
    local = np.empty_like(rows)
    relayout = {
        "store": _report.median(lambda: plan.store(flat, slots, rows), args.repeats),
        "load": _report.median(lambda: plan.load(flat, slots, local), args.repeats),
    }
    plain = {
        "store": _report.median(
            lambda: direct_pool.write_blocks(0, list(chunks), 0, rows), args.repeats
        ),
        "load": _report.median(
            lambda: direct_pool.read_blocks(0, list(chunks), 0, n, local), args.repeats
        ),
    }
    result = []
    for d in ("store", "load"):
        result.append(
            {
                "form": form,
                "tp": tp,
                "direction": d,
                "fragments": len(mapping.fragments()),
                "min_fragment_bytes": min(r.fragment_size for r in mapping.runs),
                "strided_copies": len(plan.copies),
                "job_mib": round(n * plan.local_block_bytes / 2**20, 2),
                "direct_s": out["direct"][d],
                "canonical_s": out["canonical"][d],
                "relayout_s": relayout[d],
                "plain_copy_s": plain[d],
                "relayout_over_plain": relayout[d] / plain[d],
                # What replacing the plain copy by the relayout adds, as a share of the
                # direct job (less noisy than the difference of two whole jobs).
                "relayout_extra_share": (relayout[d] - plain[d]) / out["direct"][d],
                "extra_over_direct": out["canonical"][d] / out["direct"][d] - 1,
            }
        )
    return result


TOTAL_HEADS = 16
BLOCKS_PER_CHUNK = 16


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 layers, 64 blocks, head size 64")
    ap.add_argument("--forms", nargs="+", choices=list(FORMS), default=list(FORMS))
    ap.add_argument(
        "--tp", nargs="+", type=_report.int_at_least(1), default=[1, 2, 4],
        help=f"TP sizes of the storing rank (each must divide {TOTAL_HEADS} KV heads)",
    )  # fmt: skip
    ap.add_argument("--layers", type=_report.int_at_least(1), help="(8; quick: 4)")
    ap.add_argument(
        "--blocks", type=_report.int_at_least(BLOCKS_PER_CHUNK),
        help=f"blocks per job, a multiple of {BLOCKS_PER_CHUNK} (256; quick: 64)",
    )  # fmt: skip
    ap.add_argument("--repeats", type=_report.int_at_least(1), help="(15; quick: 5)")
    _report.add_output_args(ap, pathlib.Path(__file__).resolve().parent / "results")
    _report.add_replot_arg(ap)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    bad = [tp for tp in args.tp if TOTAL_HEADS % tp]
    if bad:
        ap.error(f"--tp {bad[0]}: must divide the {TOTAL_HEADS} KV heads; use 1, 2, 4, 8 or 16")
    if args.blocks is not None and args.blocks % BLOCKS_PER_CHUNK:
        fix = -(-args.blocks // BLOCKS_PER_CHUNK) * BLOCKS_PER_CHUNK
        ap.error(f"--blocks {args.blocks}: must be a multiple of {BLOCKS_PER_CHUNK}; use {fix}")
    args.block_size, args.total_heads = 16, TOTAL_HEADS
    args.head_size = 64 if args.quick else 128
    layers, blocks, repeats = (4, 64, 5) if args.quick else (8, 256, 15)
    args.layers = args.layers or layers
    args.blocks = args.blocks or blocks
    args.repeats = args.repeats or repeats
    return args


COLUMNS = [
    _report.Col("form", "layout", text=True),
    _report.Col("tp", "TP"),
    _report.Col("fragment_kib", "fragment", "KiB", 1),
    _report.Col("direction", "job", text=True),
    _report.Col("job_mib", "size", "MiB", 0),
    _report.Col("direct_s", "direct", "ms", 1),
    _report.Col("canonical_s", "canonical", "ms", 1),
    _report.Col("relayout_over_plain", "strided/plain copy", "x"),
    _report.Col("relayout_extra_share", "relayout extra", "%"),
    _report.Col("extra_over_direct", "whole-job difference", "%"),
]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot is not None:
        return replot(args)
    cases = [(form, tp) for form in args.forms for tp in args.tp]
    progress = _report.Progress(len(cases), quiet=args.quiet)
    results = []
    for form, tp in cases:
        progress.step(f"{form}, TP={tp}: {args.blocks} blocks x {args.layers} layers")
        results += run_case(form, tp, args)
    progress.finish()
    for r in results:
        r["fragment_kib"] = r["min_fragment_bytes"] / 1024
    _report.write_csv(args.out / "canonical.csv", list(results[0]), results)
    _plot(results, args.out / "canonical.png", _report.machine())
    note = (
        f"rank 0 of each TP group; {args.layers} layers, {args.blocks} blocks of 16 tokens, "
        f"{TOTAL_HEADS} KV heads x {args.head_size}; medians of {args.repeats}, direct and "
        f"canonical alternating; {copy_threads()} host copy threads. Relayout extra = "
        "(strided - plain copy) / direct job; whole-job difference = canonical / direct - 1"
    )
    _report.emit("canonical", args, [("", results, COLUMNS)], results, note=note)
    return 0


def _plot(rows, path, info):
    """One question: what does the canonical relayout add to a job, per layout and TP?

    Plotted: the relayout share (strided minus plain host copy, over the direct job). Not
    the whole-job difference, a difference of two noisy job times (table and CSV have it).
    """
    plt = _report.pyplot()
    if plt is None:
        return
    cases = [r for r in rows if r["direction"] == "store"]
    labels = [f"{r['form']}, TP={r['tp']} ({r['fragment_kib']:g} KiB)" for r in cases]
    y = np.arange(len(cases))[::-1]  # first case on top
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.42 * len(cases) + 2.6), sharey=True)
    for ax, d in zip(axes, ("store", "load"), strict=True):
        sub = [r for r in rows if r["direction"] == d]
        ax.barh(y, [100 * r["relayout_extra_share"] for r in sub], 0.6, color="tab:blue",
                label="relayout: the strided copy minus the plain copy it replaces")  # fmt: skip
        ax.axvline(5, color="k", ls=":", label="5% target")
        ax.axvline(0, color="k", lw=0.6)
        ax.set_title(f"{d} jobs")
        ax.set_xlabel("extra time, % of the direct job")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y, labels, fontsize=8)
    height = 0.42 * len(cases) + 2.6
    fig.suptitle(
        "what the canonical relayout adds to a job (layout, TP, smallest fragment); "
        f"{rows[0]['job_mib']:.0f} MiB jobs at TP=1\nmeasured {_report.measured_on(info)}",
        fontsize=10,
        y=1 - 0.08 / height,
    )
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.55 / height),
               ncol=2, frameon=False, fontsize=8)  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.75 / height))
    _report.save(fig, path)


def replot(args) -> int:
    """`--replot FILE`: the PNG of a recorded run, nothing measured."""
    info, tables = _report.read_recorded(args.replot.read_text(), "canonical")
    _plot(_report.parse_rows(tables[0][1], COLUMNS), args.out / "canonical.png", info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
