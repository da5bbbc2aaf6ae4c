"""Before/after a refactor, in one process: an older commit's library against this tree's.

The older tree (a `git worktree` of the commit) is copied under other package names
(`jkv_before`, `pk_before`: every `jax_kvoffload` / `pallas_kernels` in its source
rewritten), so both libraries are imported side by side and run the same work,
alternating which goes first, medians over the repeats. Ratios are this tree / the old
one: > 1 means this tree is faster. Load on a shared machine hits both alike.

  manager  benchmarks/manager.py's recorded trace (its `--requests`, 2,000 chunks), on
           `HostStore` (own API) and `JaxOffloadingManager` (vLLM's interface) of both
           trees, and vLLM's `CPUOffloadingManager` as the yardstick; CPU time. An
           untimed replay first checks that all answer every call alike.
  offload  `TransferEngine` store and load jobs of benchmarks/offload.py's `--quick` sizes
           (8 layers; 64 and 8 KiB pages; 64 and 256 blocks), one engine per tree on
           its own caches; wall time of submit + wait.

Usage (not a benchmark of the library: a tool for comparing two versions of it):
  git worktree add --detach /tmp/kvo-before <commit>
  python benchmarks/_before_after.py /tmp/kvo-before manager [--requests N] [--repeats N]
  python benchmarks/_before_after.py /tmp/kvo-before offload [--repeats N]
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import random
import re
import shutil
import statistics
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ALIASES = {"jax_kvoffload": "jkv_before", "pallas_kernels": "pk_before"}


def load_old(tree: pathlib.Path) -> None:
    """Copies the old tree's packages under their aliases onto `sys.path`."""
    root = pathlib.Path(tempfile.mkdtemp(prefix="kvo-before-"))
    pattern = re.compile(r"\b(" + "|".join(ALIASES) + r")\b")
    for name, alias in ALIASES.items():
        shutil.copytree(tree / name, root / alias, ignore=shutil.ignore_patterns("__pycache__"))
        for path in (root / alias).rglob("*.py"):
            path.write_text(pattern.sub(lambda m: ALIASES[m[1]], path.read_text()))
    sys.path.insert(0, str(root))


def manager(args: argparse.Namespace) -> list[tuple[str, float]]:
    sys.path.insert(0, str(HERE))
    bench = importlib.import_module("manager")  # this tree's trace, replays and checks
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    old_store = importlib.import_module("jkv_before.store")
    old_bridge = importlib.import_module("jkv_before.bridge._vllm_manager")
    from jax_kvoffload.bridge._vllm_manager import build_manager_class
    from jax_kvoffload.store import HostStore, RequestContext

    chunks, out = 2_000, []
    requests = bench.make_requests(args.requests, 300, 1.1, 1, random.Random(0))
    for policy in ("lru", "arc"):
        ops = bench.record_trace(
            requests, chunks, policy, groups=1, concurrency=8, chunks_per_step=4,
            failure_rate=0.01, rng=random.Random(1),
        )  # fmt: skip

        def store(cls, policy=policy):
            return lambda: cls(chunks, eviction_policy=policy, enable_events=True)

        def own(store_cls, ctx_cls, name):
            return bench.Impl(name, "own", store(store_cls), ctx_cls, bench.bind_ours)

        def iface(build, store_cls, name):
            cls, make = build(), store(store_cls)
            return bench.Impl(name, "vllm", lambda: cls(make()), ReqContext, bench.bind_vllm)

        def theirs(policy=policy):
            return CPUOffloadingManager(chunks, cache_policy=policy, enable_events=True)

        vllm = bench.Impl("vllm", "vllm", theirs, ReqContext, bench.bind_vllm)
        impls = [
            own(old_store.HostStore, old_store.RequestContext, "HostStore before"),
            own(HostStore, RequestContext, "HostStore after"),
            iface(old_bridge.build_manager_class, old_store.HostStore, "manager before"),
            iface(build_manager_class, HostStore, "manager after"),
            vllm,
        ]
        bench.check_same_answers(impls, ops, requests, 1)
        times: dict[str, list[float]] = {i.name: [] for i in impls}
        for rep in range(args.repeats):
            for impl in impls if rep % 2 == 0 else impls[::-1]:
                _, calls, _ = impl.fresh(ops, requests, 1)
                times[impl.name].append(bench.replay(calls))
        t = {name: statistics.median(v) for name, v in times.items()}
        print(f"{policy}: {len(ops):,} calls; µs/call " + ", ".join(
            f"{n} {v / len(ops) * 1e6:.2f}" for n, v in t.items()), flush=True)  # fmt: skip
        out += [
            (f"{policy} HostStore (own API)", t["HostStore before"] / t["HostStore after"]),
            (f"{policy} JaxOffloadingManager (vLLM's)", t["manager before"] / t["manager after"]),
            (f"{policy} before x vLLM", t["vllm"] / t["manager before"]),
            (f"{policy} after x vLLM", t["vllm"] / t["manager after"]),
        ]
    return out


def offload(args: argparse.Namespace) -> list[tuple[str, float]]:
    import jax.numpy as jnp
    import numpy as np

    libs = []
    for pkg, kernels in (("jkv_before", "pk_before"), ("jax_kvoffload", "pallas_kernels")):
        transfer = importlib.import_module(f"{pkg}.transfer")
        try:
            pool_cls = importlib.import_module(f"{pkg}.hostmem").HostChunkPool
        except ImportError:  # before the hostmem package: pools lived in transfer
            pool_cls = transfer.HostChunkPool
        libs.append((transfer, pool_cls, importlib.import_module(kernels)))
    out = []
    for page_kib, (heads, dim) in ((64, (8, 128)), (8, (2, 64))):
        for blocks in (64, 256):
            shape = (2 * blocks, 2, 16, heads, dim)
            ids = tuple(int(i) for i in np.random.default_rng(0).permutation(2 * blocks)[:blocks])
            jobs = []
            for transfer, pool_cls, pk in libs:
                arrays = [jnp.full(shape, k, jnp.uint16) for k in range(8)]
                gc = transfer.GroupCaches(arrays, pk.KVLayout.nhd(pk.KVStacking.SECOND))
                engine = transfer.TransferEngine(
                    {0: gc}, pool_cls(blocks, {0: gc.block_bytes}, 1), backend="auto"
                )
                jobs.append((engine, transfer.GroupTransfer(0, ids, tuple(range(blocks)))))
            seconds = {(side, kind): [] for side in (0, 1) for kind in ("store", "load")}
            job = iter(range(1, 10**9))
            for rep in range(args.repeats + 1):  # the first round compiles: not counted
                for side in (0, 1) if rep % 2 == 0 else (1, 0):
                    engine, t = jobs[side]
                    for kind in ("store", "load"):
                        j = next(job)
                        start = time.perf_counter()
                        getattr(engine, f"submit_{kind}")(j, [t])
                        (result,) = engine.wait([j])
                        if rep:
                            seconds[side, kind].append(time.perf_counter() - start)
                        if not result.success:
                            raise RuntimeError(f"job failed: {result.error}")
            for engine, _ in jobs:
                engine.close()
            mib = blocks * 8 * page_kib / 1024
            for kind in ("store", "load"):
                before = statistics.median(seconds[0, kind])
                after = statistics.median(seconds[1, kind])
                gibps = f"{mib / 1024 / before:.2f} -> {mib / 1024 / after:.2f} GiB/s"
                print(f"{kind} {page_kib} KiB x {blocks} blocks ({mib:.0f} MiB): {gibps}")
                out.append((f"{kind} {page_kib} KiB pages, {blocks} blocks", before / after))
    return out


def _at_least_1(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old_tree", type=pathlib.Path, help="a checkout of the older commit")
    parser.add_argument("what", choices=("manager", "offload"))
    parser.add_argument("--requests", type=_at_least_1, default=800, help="manager: trace length")
    parser.add_argument("--repeats", type=_at_least_1, default=5, help="timed rounds (median)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_old(args.old_tree.resolve())
    started = time.time()
    rows = manager(args) if args.what == "manager" else offload(args)
    print(f"\n{args.what}: this tree / {args.old_tree} (> 1: faster now), "
          f"{time.time() - started:.0f} s")  # fmt: skip
    for name, ratio in rows:
        print(f"  {name:45s} {ratio:5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
