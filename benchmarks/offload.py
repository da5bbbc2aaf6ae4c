"""Offload (device -> host chunks) and load (host chunks -> device) throughput.

For 16-token blocks of a `layers`-layer cache it times, in one run:
  engine    the TransferEngine: gather kernel per bucket + one device_put to pinned
            host, copied into the pre-allocated chunk rows (and the reverse for loads);
  per-block one transfer per block: a one-block gather + device_put (load: device_put +
            one-block scatter), i.e. what a naive per-block path does;
  ceiling   one large device_put of the same bytes, already contiguous.
GB/s counts the bytes moved once. Ratios engine/ceiling and engine/per-block are the
targets (GPU: >= 0.9 and >= 10x; CPU: >= 5x the per-block path). Writes offload.csv and
offload.png (when matplotlib imports) under --out.

    PYTHONPATH=. python benchmarks/offload.py --quick
"""

from __future__ import annotations

import argparse
import datetime
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
from jax_kvoffload.transfer import GroupCaches, GroupTransfer, HostChunkPool, TransferEngine

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
        "per_block_store": _report.median(
            per_block_store, 1, warmup=True
        ),  # slow by design: one sample
        "ceiling_d2h": _report.median(ceiling_d2h, repeats, warmup=True),
        "engine_load": _report.median(engine_load, repeats, warmup=True),
        "per_block_load": _report.median(per_block_load, 1, warmup=True),
        "ceiling_h2d": _report.median(ceiling_h2d, repeats, warmup=True),
    }
    engine.close()
    gbs = {k: nbytes / v / 1e9 for k, v in t.items()}
    return {
        "layers": layers,
        "page_kib": 2 * BLOCK_SIZE * kv_heads * head_dim * 2 // 1024,
        "blocks": blocks,
        "mib": nbytes / 2**20,
        **{f"{k}_gbs": round(v, 3) for k, v in gbs.items()},
        "store_vs_ceiling": round(gbs["engine_store"] / gbs["ceiling_d2h"], 3),
        "store_vs_per_block": round(t["per_block_store"] / t["engine_store"], 1),
        "load_vs_ceiling": round(gbs["engine_load"] / gbs["ceiling_h2d"], 3),
        "load_vs_per_block": round(t["per_block_load"] / t["engine_load"], 1),
    }


def plot(rows: list[dict], path: pathlib.Path) -> None:
    plt = _report.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind, ceiling in ((axes[0], "store", "ceiling_d2h"), (axes[1], "load", "ceiling_h2d")):
        series = sorted({(r["layers"], r["page_kib"]) for r in rows})
        for layers, kib in series:
            sub = [r for r in rows if (r["layers"], r["page_kib"]) == (layers, kib)]
            x = [r["blocks"] for r in sub]
            styles = ((f"engine_{kind}", "o-"), (f"per_block_{kind}", "s--"), (ceiling, "k:"))
            for key, style in styles:
                label = f"{key}, {layers} layers x {kib} KiB"
                ax.plot(x, [r[f"{key}_gbs"] for r in sub], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("blocks (16 tokens each)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{kind} ({jax.devices()[0].device_kind})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sweep (< 1 min on CPU)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    sweep = QUICK if args.quick else FULL
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for page in sweep["pages"]:
        for layers in sweep["layers"]:
            for blocks in sweep["blocks"]:
                rows.append(measure(layers, blocks, page, args.repeats, args.backend))
                print(f"page={page} layers={layers} blocks={blocks} done", file=sys.stderr)
    header = (
        f"# offload benchmark {datetime.date.today()} {platform.node()} "
        f"{jax.devices()[0].device_kind} jax {jax.__version__}"
    )
    cols = [
        "layers", "page_kib", "blocks", "mib",
        "engine_store_gbs", "per_block_store_gbs", "ceiling_d2h_gbs",
        "store_vs_ceiling", "store_vs_per_block", "engine_load_gbs", "per_block_load_gbs",
        "ceiling_h2d_gbs", "load_vs_ceiling", "load_vs_per_block",
    ]  # fmt: skip
    _report.write_csv(out / "offload.csv", cols, rows)
    plot(rows, out / "offload.png")
    print(header)
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) if not isinstance(r[c], float) else f"{r[c]:.3g}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
