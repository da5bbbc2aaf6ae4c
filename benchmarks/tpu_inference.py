"""tpu-inference 0.32.0's offload connector, with its host backend and with ours.

Two workers of the `TPUOffloadConnector` interface, fed the same metadata (theirs, as
their scheduler emits it), on the same RPA v3 caches and the harness's CPU mesh
(tests/tpu_inference/):

  theirs  tpu-inference's worker and `LocalCPUBackend` (a dict of per-block
          `pinned_host` arrays): their pure-JAX gather / scatter on an attn_dp mesh and
          one device_put per block
  ours    `jax_kvoffload.bridge.tpu_inference.TPUOffloadConnector`'s worker: our gather
          kernel into one staging array per bucket, one device_put per bucket, our host
          pool rows; loads back the same way and our scatter

Per job of `--blocks` blocks it times, alternating, in the same run: each connector's
save (until the worker reports every chunk saved) and load (until the caches are
ready), and one device_put of the same bytes each way (d2h, h2d: the copy a save or load
cannot beat). It reports throughput, the ratios ours/theirs (the issue's target: >= 1.0)
and each against the plain copies (median of `--repeats`). Their load on a mesh without
attn_dp is a Pallas TPU DMA kernel with no CPU lowering: TPU only, not measured yet
(docs/tpu_inference.md).

    python benchmarks/tpu_inference.py --quick           # about a minute on 2 CPU cores
    python benchmarks/tpu_inference.py --blocks 8 32 128 --layers 8 --dtype float8_e4m3fn
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import subprocess
import sys
import time

# This file's name is tpu-inference's package name, and its folder holds modules named like
# packages other libraries probe for (kernels, offload, ...): the folder (sys.path[0] when
# run as a script) stays off sys.path, and _report is loaded from its file.
HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(ROOT))
_spec = importlib.util.spec_from_file_location("_report", HERE / "_report.py")
_report = sys.modules.setdefault("_report", importlib.util.module_from_spec(_spec))
if not hasattr(_report, "Col"):
    _spec.loader.exec_module(_report)

FULL = {"blocks": [4, 16, 64], "layers": 8, "kv_heads": 8, "head_dim": 128, "block_size": 32}
QUICK = {"blocks": [4, 16], "layers": 2, "kv_heads": 4, "head_dim": 128, "block_size": 16}
DTYPES = ("bfloat16", "float8_e4m3fn", "int8", "float32")
DEVICES = 4
THEIRS = "tpu_inference.offload.tpu_offload_connector:TPUOffloadConnector"
OURS = "jax_kvoffload.bridge.tpu_inference:TPUOffloadConnector"
CONNECTORS = {"theirs": THEIRS, "ours": OURS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small sweep (about a minute)")
    parser.add_argument("--repeats", type=_report.int_at_least(1), default=5)
    parser.add_argument("--blocks", nargs="+", type=_report.int_at_least(1), help="blocks per job")
    parser.add_argument("--layers", type=_report.int_at_least(1), help="attention layers")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="KV cache dtype")
    parser.add_argument(
        "--cache-blocks",
        type=_report.int_at_least(2),
        default=None,
        help="blocks per layer's cache (default: twice the job's; an engine's is far larger: "
        "on XLA:CPU a bf16 or fp8 scatter copies the whole cache, on a TPU it does not)",
    )
    parser.add_argument(
        "--settle-ms",
        type=float,
        default=50.0,
        help="pause before each timed job, so that none pays for the one before (ms)",
    )
    _report.add_output_args(parser, HERE / "results")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def _metadata(types, req_id: str, blocks: list[int], chunks: list[int], bs: int, save: bool):
    tokens = list(range(len(blocks) * bs))
    if save:
        spec = types.SaveSpec(
            num_skip_leading_tokens=0,
            num_total_tokens=len(tokens),
            src_blocks=blocks,
            dst_chunks=chunks,
        )
        meta = types.TPUReqMeta(req_id, tokens, blocks, save_spec=spec)
    else:
        spec = types.LoadSpec(
            num_matched_tokens=len(tokens), src_chunks=chunks, dst_blocks=blocks, can_load=True
        )
        meta = types.TPUReqMeta(req_id, tokens, blocks, load_spec=spec)
    return types.TPUOffloadConnectorMetadata(requests_meta=[meta])


def _jobs(stack, types, roles, connector, caches, m, n: int, bs: int) -> dict:
    """Save and load jobs of n blocks through one connector's worker."""
    import jax

    worker = stack.load_connector(connector)(stack.EngineConfig(bs, connector), roles.WORKER)
    runner = stack.Runner(caches, m)
    worker.register_runner(runner)
    src, dst, chunks = list(range(n)), list(range(n, 2 * n)), list(range(n))

    def save() -> None:
        worker.bind_connector_metadata(_metadata(types, "s", src, chunks, bs, save=True))
        worker.start_load_kv(None)
        worker.wait_for_save()
        done, deadline = 0, time.monotonic() + 600
        while done < n:
            stats = worker.get_kv_connector_stats()
            if stats is not None:
                done += sum(len(v) for v in stats.data["finished_save_chunks"].values())
            if time.monotonic() > deadline:
                raise RuntimeError(f"benchmark save: {done} of {n} chunks reported in 600 s")
            time.sleep(0)  # let the worker's save thread run
        worker.clear_connector_metadata()

    def load() -> None:
        worker.bind_connector_metadata(_metadata(types, "l", dst, chunks, bs, save=False))
        worker.start_load_kv(None)
        jax.block_until_ready(runner.kv_caches)
        worker.clear_connector_metadata()

    return {"save": save, "load": load}


def measure(
    stack,
    types,
    roles,
    n: int,
    sweep: dict,
    dtype_name: str,
    repeats: int,
    cache_blocks: int | None = None,
    settle_s: float = 0.0,
) -> dict:
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    bs, layers = sweep["block_size"], sweep["layers"]
    m, spec = stack.mesh("attn_dp")
    dtype = stack.DTYPES[dtype_name]
    total = max(2 * n, cache_blocks or 0)
    total += total % 2  # whole blocks on each of the 2 attn_dp shards
    shape = stack.cache_shape(m, total, bs, sweep["kv_heads"], sweep["head_dim"], dtype)
    page = shape[1:]
    nbytes = n * layers * int(jax.numpy.dtype(dtype).itemsize)
    for d in page:
        nbytes *= d
    jobs = {}
    for who, connector in CONNECTORS.items():  # each worker owns (donates) its caches
        caches, _ = stack.make_caches(m, spec, [shape] * layers, dtype, seed=1)
        for k, job in _jobs(stack, types, roles, connector, caches, m, n, bs).items():
            jobs[f"{who}_{k}"] = job
    # The same bytes as one array, sharded as their chunks are (heads over "model").
    staging = jax.device_put(
        stack.random_values((n, layers, *page), dtype, 5),
        NamedSharding(m, P(None, None, None, "model")),
    )
    host_kind = NamedSharding(m, P(None, None, None, "model"), memory_kind="pinned_host")
    device_kind = NamedSharding(m, P(None, None, None, "model"), memory_kind="device")
    host = {}

    def d2h() -> None:
        host["x"] = jax.block_until_ready(jax.device_put(staging, host_kind))

    def h2d() -> None:
        jax.block_until_ready(jax.device_put(host["x"], device_kind))

    jobs.update({"d2h": d2h, "h2d": h2d})
    for job in jobs.values():  # warm-up: every shape compiles once
        job()
    samples: dict[str, list[float]] = {k: [] for k in jobs}
    for _ in range(repeats):  # alternating: drift hits every job alike
        for name, job in jobs.items():
            # Each job starts once the one before it has drained: on XLA:CPU a job's
            # leftovers (its freed cache copies) otherwise run into the next one's time.
            time.sleep(settle_s)
            samples[name].append(_report.median(job, 1))
    t = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    row = {"blocks": n, "layers": layers, "cache_shape": "x".join(map(str, shape))}
    row.update({"bytes": nbytes, "mib": nbytes / _report.MIB})
    row.update({f"{k}_s": v for k, v in t.items()})
    row.update({f"{k}_gibps": _report.gib_per_s(nbytes, v) for k, v in t.items()})
    row["save_ours_vs_theirs"] = t["theirs_save"] / t["ours_save"]
    row["load_ours_vs_theirs"] = t["theirs_load"] / t["ours_load"]
    for who in CONNECTORS:
        row[f"{who}_save_vs_d2h"] = t["d2h"] / t[f"{who}_save"]
        row[f"{who}_load_vs_h2d"] = t["h2d"] / t[f"{who}_load"]
    return row


def plot(rows: list[dict], path: pathlib.Path) -> None:
    plt = _report.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    mib = [r["mib"] for r in rows]
    for key, label in (
        ("theirs_save_gibps", "their save"),
        ("theirs_load_gibps", "their load"),
        ("ours_save_gibps", "our save"),
        ("ours_load_gibps", "our load"),
        ("d2h_gibps", "one D2H copy"),
        ("h2d_gibps", "one H2D copy"),
    ):
        ax.plot(mib, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per job (MiB)")
    ax.set_ylabel("GiB/s")
    ax.set_title("tpu-inference 0.32.0 offload: their backend vs ours")
    ax.legend()
    _report.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "jax" in sys.modules:  # `jax-kvoffload bench`: jax started here before the CPU mesh was set
        argv = sys.argv[1:] if argv is None else argv
        return subprocess.call([sys.executable, str(pathlib.Path(__file__).resolve()), *argv])
    sweep = dict(QUICK if args.quick else FULL)
    if args.layers:
        sweep["layers"] = args.layers
    blocks = args.blocks or sweep["blocks"]
    from tests.tpu_inference import _env

    _env.prepare(DEVICES)
    os.environ["TPU_OFFLOAD_NUM_CPU_CHUNKS"] = str(max(blocks))
    import vllm.distributed.kv_transfer.kv_connector.v1.base as base
    from tpu_inference.offload import tpu_offload_connector as types

    from tests.tpu_inference import _their_stack as stack

    progress = _report.Progress(len(blocks), quiet=args.quiet)
    rows = []
    for n in blocks:
        progress.step(f"{n} blocks, {sweep['layers']} layers, {args.dtype}")
        rows.append(
            measure(
                stack,
                types,
                base.KVConnectorRole,
                n,
                sweep,
                args.dtype,
                args.repeats,
                args.cache_blocks,
                args.settle_ms / 1e3,
            )
        )
    progress.finish()
    _report.write_csv(args.out / "tpu_inference.csv", list(rows[0]), rows)
    plot(rows, args.out / "tpu_inference.png")
    Col = _report.Col
    cols = [
        Col("blocks", "blocks"),
        Col("mib", "job", "MiB", 2),
        Col("theirs_save_gibps", "their save", "GiB/s"),
        Col("ours_save_gibps", "our save", "GiB/s"),
        Col("save_ours_vs_theirs", "save ours/theirs", "x"),
        Col("theirs_load_gibps", "their load", "GiB/s"),
        Col("ours_load_gibps", "our load", "GiB/s"),
        Col("load_ours_vs_theirs", "load ours/theirs", "x"),
    ]
    copies = [
        Col("blocks", "blocks"),
        Col("d2h_gibps", "one D2H", "GiB/s"),
        Col("theirs_save_vs_d2h", "their save/D2H", "x"),
        Col("ours_save_vs_d2h", "our save/D2H", "x"),
        Col("h2d_gibps", "one H2D", "GiB/s"),
        Col("theirs_load_vs_h2d", "their load/H2D", "x"),
        Col("ours_load_vs_h2d", "our load/H2D", "x"),
    ]
    note = (
        f"median of {args.repeats} alternating runs, {args.settle_ms:g} ms apart; "
        f"{args.dtype} RPA v3 caches "
        f"{rows[0]['cache_shape']} per layer on a {DEVICES}-device attn_dp x model CPU mesh; "
        "theirs: LocalCPUBackend (pinned_host arrays per block); ours: our kernels and pool"
    )
    tables = [("their connector vs ours", rows, cols), ("against one plain copy", rows, copies)]
    _report.emit("tpu_inference", args, tables, rows, note=note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
