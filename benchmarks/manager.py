"""Host-store manager throughput on a synthetic prefix-sharing trace, LRU vs ARC.

Each request has a shared prefix drawn from a Zipf distribution over a fixed set of
prefixes, plus a few unique chunks. Per request, as vLLM's scheduler does: look the
keys up until the first miss, load (pin, unpin) the hit prefix, offer every key for
storing, complete the store, finish the request. Reported: lookups per second (the
lookup phase alone), stored-key offers per second (prepare_store + complete_store),
requests per second and the hit rate. The trace is generated before timing.

Usage:
  python benchmarks/manager.py            # 100k requests
  python benchmarks/manager.py --quick    # 5k requests, a few seconds
  python benchmarks/manager.py --out DIR  # CSV + PNG (default benchmarks/results/)

If vLLM is importable, its CPUOffloadingManager runs the same trace for comparison.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import pathlib
import random
import sys
import time
from collections.abc import Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _report, beside us
import _report

from jax_kvoffload.store import HostStore, LookupResult, RequestContext, make_offload_key

TOKENS_PER_CHUNK = 16


def make_trace(num_requests: int, num_prefixes: int, zipf_a: float, seed: int) -> list[list[bytes]]:
    """Returns per request its chunk keys, head to tail."""
    rng = random.Random(seed)
    weights = [1.0 / (rank**zipf_a) for rank in range(1, num_prefixes + 1)]
    cumulative = list(itertools.accumulate(weights))
    total = cumulative[-1]
    prefix_lengths = [rng.randint(4, 32) for _ in range(num_prefixes)]
    prefix_keys = [
        [make_offload_key(b"p%d:%d" % (p, i), 0) for i in range(prefix_lengths[p])]
        for p in range(num_prefixes)
    ]
    trace = []
    for r in range(num_requests):
        prefix = bisect.bisect_left(cumulative, rng.random() * total)
        suffix = [make_offload_key(b"r%d:%d" % (r, i), 0) for i in range(rng.randint(1, 8))]
        trace.append(prefix_keys[min(prefix, num_prefixes - 1)] + suffix)
    return trace


def run_ours(trace: list[list[bytes]], num_chunks: int, policy: str) -> dict[str, float]:
    store = HostStore(num_chunks, eviction_policy=policy)
    hit, pending = LookupResult.HIT, LookupResult.HIT_PENDING
    lookup_s = store_s = 0.0
    lookups = offers = hits = 0
    clock = time.perf_counter
    start = clock()
    for keys in trace:
        ctx = RequestContext()
        for i, key in enumerate(keys):
            ctx.set_key_position(key, (i + 1) * TOKENS_PER_CHUNK)
        t0 = clock()
        num_hits = 0
        for key in keys:
            result = store.lookup(key, ctx)
            if result is not hit and result is not pending:
                break
            num_hits += 1
        lookups += min(num_hits + 1, len(keys))
        t1 = clock()
        loadable = [k for k in keys[:num_hits] if store.lookup(k, ctx) is hit]
        if loadable:
            store.prepare_load(loadable, ctx)
            store.complete_load(loadable, ctx)
        hits += num_hits
        t2 = clock()
        output = store.prepare_store(keys, ctx)
        if output is not None and output.keys_to_store:
            store.complete_store(output.keys_to_store, ctx=ctx)
        offers += len(keys)
        store.on_request_finished(ctx)
        t3 = clock()
        lookup_s += t1 - t0
        store_s += t3 - t2
    wall = clock() - start
    return _result(
        policy, "jax_kvoffload", len(trace), lookups, offers, hits, lookup_s, store_s, wall
    )


def _result(policy, impl, requests, lookups, offers, hits, lookup_s, store_s, wall):
    return {
        "impl": impl,
        "policy": policy,
        "requests": requests,
        "lookups_per_s": lookups / lookup_s if lookup_s else 0.0,
        "store_offers_per_s": offers / store_s if store_s else 0.0,
        "requests_per_s": requests / wall,
        "hit_rate": hits / offers if offers else 0.0,
        "wall_s": wall,
    }


def run_vllm(trace: list[list[bytes]], num_chunks: int, policy: str) -> dict[str, float] | None:
    """The same trace on vLLM's CPUOffloadingManager, if vLLM is importable."""
    try:
        from vllm.v1.kv_offload.base import LookupResult as VLookup
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    except Exception:  # vLLM absent or a version with another layout
        return None
    manager = CPUOffloadingManager(num_chunks, cache_policy=policy)
    hit, pending = VLookup.HIT, VLookup.HIT_PENDING
    lookup_s = store_s = 0.0
    lookups = offers = hits = 0
    clock = time.perf_counter
    start = clock()
    for n, keys in enumerate(trace):
        ctx = ReqContext(str(n), None, None)
        t0 = clock()
        num_hits = 0
        for key in keys:
            if manager.lookup(key, ctx) not in (hit, pending):
                break
            num_hits += 1
        lookups += min(num_hits + 1, len(keys))
        t1 = clock()
        loadable = [k for k in keys[:num_hits] if manager.lookup(k, ctx) is hit]
        if loadable:
            manager.prepare_load(loadable, ctx)
            manager.complete_load(loadable, ctx)
        hits += num_hits
        t2 = clock()
        output = manager.prepare_store(keys, ctx)
        if output is not None and output.keys_to_store:
            manager.complete_store(output.keys_to_store, ctx)
        offers += len(keys)
        manager.on_request_finished(ctx)
        t3 = clock()
        lookup_s += t1 - t0
        store_s += t3 - t2
    wall = clock() - start
    return _result(policy, "vllm", len(trace), lookups, offers, hits, lookup_s, store_s, wall)


def write_outputs(rows: list[dict[str, float]], out: pathlib.Path) -> None:
    _report.write_csv(out / "manager.csv", list(rows[0]), rows)
    plt = _report.pyplot()
    if plt is None:
        return
    labels = [f"{r['impl']}\n{r['policy']}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, metric, title in (
        (axes[0], "lookups_per_s", "lookups / s"),
        (axes[1], "store_offers_per_s", "stored-key offers / s"),
    ):
        ax.bar(labels, [r[metric] for r in rows], color="tab:blue")
        ax.set_title(title)
    fig.suptitle(f"HostStore on a Zipf prefix-sharing trace ({rows[0]['requests']} requests)")
    fig.tight_layout()
    fig.savefig(out / "manager.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5k requests (a few seconds)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--prefixes", type=int, default=2000)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--chunks", type=int, default=20_000, help="host store capacity")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results"
    )
    args = parser.parse_args(argv)
    num_requests = args.requests or (5_000 if args.quick else 100_000)
    trace = make_trace(num_requests, args.prefixes, args.zipf, args.seed)
    runners: list[Callable[..., dict[str, float] | None]] = [run_ours, run_vllm]
    rows = []
    for policy in ("lru", "arc"):
        for runner in runners:
            row = runner(trace, args.chunks, policy)
            if row is not None:
                rows.append(row)
    if not any(r["impl"] == "vllm" for r in rows):
        print("vllm not importable: comparison skipped")
    header = f"{'impl':<14}{'policy':<8}{'lookups/s':>14}{'offers/s':>14}{'req/s':>10}{'hit':>7}"
    print(header)
    for r in rows:
        print(
            f"{r['impl']:<14}{r['policy']:<8}{r['lookups_per_s']:>14,.0f}"
            f"{r['store_offers_per_s']:>14,.0f}{r['requests_per_s']:>10,.0f}{r['hit_rate']:>7.1%}"
        )
    write_outputs(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
