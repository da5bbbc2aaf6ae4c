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
  python benchmarks/canonical.py            # 16-token blocks, 16 KV heads x 128, bf16
  python benchmarks/canonical.py --quick    # small sizes, a few seconds
  python benchmarks/canonical.py --out DIR  # CSV + PNG (default benchmarks/results/)
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _report, beside us
import _report
import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from jax_kvoffload.config import FullAttentionSpec, KVTensorView, RankContext, layer_mapping
from jax_kvoffload.transfer import (
    CanonicalPoolView,
    GroupCaches,
    GroupTransfer,
    HostChunkPool,
    TransferEngine,
    plan_for_group,
)
from jax_kvoffload.transfer._strided import copy_threads

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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = ap.parse_args()
    args.block_size, args.total_heads, args.head_size = 16, 16, 128
    args.layers, args.blocks, args.repeats = (4, 64, 5) if args.quick else (8, 256, 15)
    if args.quick:
        args.head_size = 64
    print(
        f"# {datetime.date.today()} {platform.machine()} {os.cpu_count()} CPUs, jax "
        f"{jax.__version__} on {jax.devices()[0].device_kind}, host copy threads "
        f"{copy_threads()}"
    )
    results = [r for form in FORMS for tp in (1, 2, 4) for r in run_case(form, tp, args)]
    cols = [
        "form",
        "tp",
        "direction",
        "fragments",
        "min_fragment_bytes",
        "strided_copies",
        "job_mib",
        "direct_s",
        "canonical_s",
        "relayout_s",
        "plain_copy_s",
        "relayout_over_plain",
        "relayout_extra_share",
        "extra_over_direct",
    ]
    _report.report(pathlib.Path(args.out), "canonical", cols, results, _plot)


def _plot(rows, path):
    plt = _report.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, d in zip(axes, ("store", "load"), strict=True):
        sub = [r for r in rows if r["direction"] == d]
        labels = [f"{r['form']}\ntp{r['tp']}" for r in sub]
        x = np.arange(len(sub))
        ax.bar(x - 0.2, [100 * r["extra_over_direct"] for r in sub], 0.4, label="whole job")
        ax.bar(
            x + 0.2,
            [100 * r["relayout_extra_share"] for r in sub],
            0.4,
            label="relayout - plain copy",
        )
        ax.axhline(5, color="k", ls=":", label="5% target")
        ax.axhline(0, color="k", lw=0.5)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_title(f"{d}: canonical job vs direct job")
        ax.set_ylabel("extra time over direct (%)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
