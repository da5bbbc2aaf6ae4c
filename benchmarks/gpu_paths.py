"""The accelerator data path against the copies it should match: P1-P4 of docs/kernels.md.

For 16-token blocks (`blocks` per job, pages of `page_kib` KiB, `layers` tensors) it
times, for the JAX engine (`TransferEngine`, its pool as `host_pool="auto"` picks it:
pinned rows on an accelerator) and for the vLLM worker path (`TorchKVWorker`, its
copy-engine path: pinned slots, per-lane streams):

  P1  gather and scatter of the job's blocks vs the same device's copy of as many
      contiguous bytes (torch path here; the JAX kernels' P1 is benchmarks/kernels.py);
  P2  a store job vs one large pinned D2H copy of the same bytes;
  P3  a load job vs one large pinned H2D copy of the same bytes;
  P4  the job vs the per-block path (one gather/copy per block, synchronous).

Each row has its target (design card: P1 >= 0.85, P2, P3 >= 0.90, P4 >= 10x), met only
where it is measured on a GPU: on CPU (`--cpu-dry-run`, tiny sizes) the script checks
that every step runs, the numbers mean nothing. Writes gpu_paths.csv under --out.

    python benchmarks/gpu_paths.py --quick --out /tmp/gpu     # < 1 min on an H100
    python benchmarks/gpu_paths.py --cpu-dry-run --out /tmp/dry
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
import traceback
from collections.abc import Callable
from types import SimpleNamespace as Spec

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _report, beside us
import _report

import pallas_kernels as pk
from jax_kvoffload.hostmem import build_host_pool
from jax_kvoffload.transfer import GroupCaches, GroupTransfer, TransferEngine

BLOCK_TOKENS = 16
BPC = 16  # device blocks per host chunk (vLLM: 256-token chunks of 16-token blocks)
TARGETS = {"P1": 0.85, "P2": 0.90, "P3": 0.90, "P4": 10.0}
SIZES = {  # (layers, page KiB, blocks per job)
    "full": [(8, 16, 256), (8, 64, 256), (32, 16, 1024)],
    "quick": [(8, 16, 256), (8, 64, 256)],
    "dry": [(2, 8, 32)],
}


def timed(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    def run():
        fn()
        sync()

    return _report.median(run, repeats, warmup=True)


def row(path: str, check: str, what: str, case: str, job_s: float, ref_s: float) -> dict:
    """One P-row: the ratio is reference time / job time (P4: per-block / job)."""
    return {
        "path": path,
        "check": check,
        "what": what,
        "case": case,
        "job_s": job_s,
        "reference_s": ref_s,
        "ratio": ref_s / job_s if job_s > 0 else float("nan"),
        "target": TARGETS[check],
    }


# -- the JAX engine ---------------------------------------------------------------------


def jax_rows(layers: int, page_kib: int, blocks: int, repeats: int, case: str) -> list[dict]:
    device = jax.devices()[0]
    on_cpu = device.platform == "cpu"
    words = page_kib * 1024 // 2  # uint16 words per layer page
    per_token = words // BLOCK_TOKENS
    head_dim = min(128, per_token)
    shape = (2 * blocks, BLOCK_TOKENS, per_token // head_dim, head_dim)
    arrays = [jnp.full(shape, k, jnp.uint16) for k in range(layers)]
    gc = GroupCaches(arrays, pk.KVLayout.nhd())
    chunks = -(-blocks // BPC)
    # The pool an accelerator gets from host_pool="auto" (the pinned rows), on CPU too.
    pool, _ = build_host_pool(chunks, {0: gc.block_bytes}, BPC, kind="auto", accelerator=True)
    # On CPU the accelerator's path is forced (pinned host device_puts) so that every
    # step of it runs; its times are not the GPU's.
    engine = TransferEngine({0: gc}, pool, device_path=on_cpu)
    ids = tuple(int(i) for i in np.random.default_rng(0).permutation(2 * blocks)[:blocks])
    transfer = GroupTransfer(0, ids, tuple(range(chunks)))
    nbytes = blocks * gc.block_bytes
    jobs = iter(range(1, 10**9))

    def job(submit):
        def run():
            j = next(jobs)
            submit(j, [transfer])
            (result,) = engine.wait([j])
            if not result.success:
                raise RuntimeError(f"benchmark job failed: {result.error}")

        return run

    host = arrays[0].sharding.with_memory_kind("pinned_host")
    flat = jnp.zeros((nbytes // 2,), jnp.uint16)
    pinned = jax.block_until_ready(jax.device_put(flat, host))
    none = lambda: None  # noqa: E731  (each timed call blocks itself)
    store = timed(job(engine.submit_store), repeats, none)
    d2h = timed(lambda: jax.block_until_ready(jax.device_put(flat, host)), repeats, none)
    load = timed(job(engine.submit_load), repeats, none)
    h2d = timed(
        lambda: jax.block_until_ready(jax.device_put(pinned, arrays[0].sharding)), repeats, none
    )

    def per_block_store():
        cur = engine.arrays(0)
        for b in ids:
            one = pk.gather_blocks(cur, np.array([b], np.int32), layout=gc.layout)
            jax.block_until_ready(jax.device_put(one, host))

    per_block = timed(per_block_store, 1, none)
    engine.close()
    name = f"JAX engine ({type(pool).__name__})"
    return [
        row(name, "P2", "store vs one pinned D2H copy", case, store, d2h),
        row(name, "P3", "load vs one pinned H2D copy", case, load, h2d),
        row(name, "P4", "store vs per-block gather + D2H", case, store, per_block),
    ]


# -- the vLLM worker path ---------------------------------------------------------------


def torch_rows(layers: int, page_kib: int, blocks: int, repeats: int, case: str) -> list[dict]:
    import torch

    from jax_kvoffload.bridge.torch import TorchKVWorker

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    page = page_kib * 1024
    tensors = [
        torch.zeros((2 * blocks, page), dtype=torch.uint8, device=device) for _ in range(layers)
    ]
    chunks = -(-blocks // BPC)
    worker = TorchKVWorker(
        [(t, page) for t in tensors],
        [[(i, page) for i in range(layers)]],
        blocks_per_chunk=BPC,
        num_chunks=chunks,
        dma=True,  # the default on CUDA; forced on CPU
    )
    ids = [int(i) for i in np.random.default_rng(0).permutation(2 * blocks)[:blocks]]
    gpu = Spec(block_ids=ids, group_sizes=None, block_indices=None)
    cpu = Spec(block_ids=list(range(chunks)))
    nbytes = layers * blocks * page
    jobs = iter(range(1, 10**9))

    def job(load: bool):
        def run():
            j = next(jobs)
            if load:
                worker.submit_load(j, cpu, gpu)
            else:
                worker.submit_store(j, gpu, cpu)
            worker.wait([j])
            (result,) = worker.get_finished()
            if not result.success:
                raise RuntimeError("benchmark job failed")

        return run

    index = torch.as_tensor(ids, device=device)
    staging = torch.empty((blocks, page), dtype=torch.uint8, device=device)
    src = torch.empty((blocks, page), dtype=torch.uint8, device=device)
    wide = [t.view(torch.int64) for t in tensors]

    def gather():
        for t in wide:
            torch.index_select(t, 0, index, out=staging.view(torch.int64))

    def scatter():
        for t in wide:
            t.index_copy_(0, index, staging.view(torch.int64))

    def device_copy():
        for _ in wide:
            staging.copy_(src)

    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    slots = worker.pool.flat(0)

    def per_block_store():
        for t in tensors:
            for k, b in enumerate(ids):
                torch.from_numpy(slots[k]).copy_(t[b])

    t_copy = timed(device_copy, repeats, sync)
    out = [
        row(
            "vLLM worker path",
            "P1",
            "gather vs device copy",
            case,
            timed(gather, repeats, sync),
            t_copy,
        ),
        row(
            "vLLM worker path",
            "P1",
            "scatter vs device copy",
            case,
            timed(scatter, repeats, sync),
            t_copy,
        ),
    ]
    store = timed(job(load=False), repeats, sync)
    d2h = timed(lambda: pinned.copy_(flat, non_blocking=True), repeats, sync)
    load = timed(job(load=True), repeats, sync)
    h2d = timed(lambda: flat.copy_(pinned, non_blocking=True), repeats, sync)
    per_block = timed(per_block_store, 1, sync)
    worker.shutdown()
    out += [
        row("vLLM worker path", "P2", "store vs one pinned D2H copy", case, store, d2h),
        row("vLLM worker path", "P3", "load vs one pinned H2D copy", case, load, h2d),
        row("vLLM worker path", "P4", "store vs per-block D2H copies", case, store, per_block),
    ]
    return out


COLUMNS = [
    _report.Col("check", "check"),
    _report.Col("path", "path"),
    _report.Col("what", "what"),
    _report.Col("case", "case"),
    _report.Col("job_s", "job", "ms"),
    _report.Col("reference_s", "reference", "ms"),
    _report.Col("ratio", "ratio", "x"),
    _report.Col("target", "target", "x"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="two cases (< 1 min on a GPU)")
    sizes.add_argument(
        "--cpu-dry-run", action="store_true", help="tiny sizes on CPU: every step runs"
    )
    parser.add_argument("--repeats", type=_report.int_at_least(1), default=5)
    parser.add_argument("--paths", nargs="+", choices=["jax", "torch"], default=["jax", "torch"])
    _report.add_output_args(parser, pathlib.Path(__file__).resolve().parent / "results")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = SIZES["dry" if args.cpu_dry_run else "quick" if args.quick else "full"]
    repeats = 3 if args.cpu_dry_run else args.repeats  # the 2nd load still compiles
    progress = _report.Progress(len(sizes) * len(args.paths), quiet=args.quiet)
    rows: list[dict] = []
    failed: list[str] = []
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    for layers, page_kib, blocks in sizes:
        case = f"{layers} L x {page_kib} KiB x {blocks}"
        for path in args.paths:
            progress.step(f"{path}: {case}")
            measure = jax_rows if path == "jax" else torch_rows
            try:
                rows += measure(layers, page_kib, blocks, repeats, case)
            except Exception:  # one path failing (no CUDA torch, say) keeps the other's rows
                traceback.print_exc()
                failed.append(f"{path}: {case}")
                continue
            # Written after every case: a step that times out leaves what it measured.
            _report.write_csv(args.out / "gpu_paths.csv", list(rows[0]), rows)
    progress.finish()
    if not rows:
        print(f"error: every case failed ({failed})", file=sys.stderr)
        return 1
    platform = jax.devices()[0].platform
    took = time.perf_counter() - started
    note = f"{platform}, median of {repeats} runs (per-block: 1), {took:.0f} s"
    if platform == "cpu":
        note += "; CPU DRY RUN: checks that every step runs, the ratios mean nothing"
    _report.emit(
        "gpu_paths", args, [("P1-P4 against their references", rows, COLUMNS)], rows, note=note
    )
    if failed:
        print(f"error: these cases failed (tracebacks above): {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
