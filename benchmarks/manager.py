"""Scheduler-side manager speed: ours against vLLM 0.33.0's, on one recorded call trace.

A scheduler simulation (Zipf-distributed shared prefixes plus private tails, several
requests in flight, jobs completing a step later, one `take_events` and `get_stats` per
step, as vLLM's connector calls them) is recorded once as a list of manager calls. The
same calls are then replayed, alternately, on

* vLLM's `CPUOffloadingManager` through vLLM's `OffloadingManager` interface,
* our `JaxOffloadingManager` (a `HostStore` behind that interface), with the same
  vLLM `ReqContext`s, and
* our `HostStore` through its own API (our `RequestContext`),

fresh managers and contexts each repeat, medians over the repeats. Before timing, one
checked replay asserts that both managers return the same answers (chunk ids included).
A second table times `lookup` alone (the scheduler's most frequent call) on the state
the trace left. Without vLLM only our own API runs.

Usage:
  python benchmarks/manager.py                 # small trace, a few seconds
  python benchmarks/manager.py --full          # 20k requests (~0.5M calls, minutes)
  python benchmarks/manager.py --json          # machine-readable result on stdout
  python benchmarks/manager.py --out DIR       # CSV + PNG (default benchmarks/results/)
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import itertools
import pathlib
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _report, beside us
import _report

from jax_kvoffload.store import HostStore, LookupResult, RequestContext, make_offload_key

TOKENS_PER_CHUNK = 16
# Op codes of a recorded trace: (op, request index, payload).
LOOKUP, LOAD, DONE_LOAD, STORE, DONE_STORE, FAIL_STORE, NEW, FINISH, EVENTS, STATS = range(10)


# --- the trace ---


def make_requests(
    num_requests: int, num_prefixes: int, zipf_a: float, groups: int, rng: random.Random
) -> list[list[bytes]]:
    """Per request its keys, head to tail, group-major per chunk (32-byte hashes)."""
    weights = list(itertools.accumulate(1.0 / rank**zipf_a for rank in range(1, num_prefixes + 1)))
    prefixes = [[rng.randbytes(32) for _ in range(rng.randint(4, 32))] for _ in range(num_prefixes)]
    out = []
    for _ in range(num_requests):
        p = min(bisect.bisect_left(weights, rng.random() * weights[-1]), num_prefixes - 1)
        hashes = prefixes[p] + [rng.randbytes(32) for _ in range(rng.randint(1, 8))]
        out.append([make_offload_key(h, g) for h in hashes for g in range(groups)])
    return out


def record_trace(
    requests: list[list[bytes]],
    num_chunks: int,
    policy: str,
    *,
    groups: int,
    concurrency: int,
    chunks_per_step: int,
    failure_rate: float,
    rng: random.Random,
) -> list[tuple[int, int, Any]]:
    """Runs a scheduler simulation on a `HostStore` and records its calls."""
    store = HostStore(num_chunks, eviction_policy=policy, enable_events=True)
    contexts = [RequestContext(str(i)) for i in range(len(requests))]
    for ctx, keys in zip(contexts, requests, strict=True):
        for i, key in enumerate(keys):
            ctx.set_key_position(key, (i // groups + 1) * TOKENS_PER_CHUNK)
    ops: list[tuple[int, int, Any]] = []
    pending = iter(range(len(requests)))
    running: dict[int, int] = {}  # request -> next key to offer
    jobs: list[tuple[int, int, list[bytes]]] = []  # (op, request, keys), done next step
    step_chunks = chunks_per_step * groups
    while True:
        for op, r, keys in jobs:
            if op == STORE and rng.random() < failure_rate:
                op = FAIL_STORE
            ops.append(({STORE: DONE_STORE, FAIL_STORE: FAIL_STORE, LOAD: DONE_LOAD}[op], r, keys))
            if op == LOAD:
                store.complete_load(keys, contexts[r])
            else:
                store.complete_store(keys, op == STORE, contexts[r])
        jobs = []
        while len(running) < concurrency:
            r = next(pending, None)
            if r is None:
                break
            ctx, keys = contexts[r], requests[r]
            ops.append((NEW, r, None))
            store.on_new_request(ctx)
            hits = 0
            for key in keys:  # the scheduler's prefix lookup: stop at the first miss
                result = store.lookup(key, ctx)
                ops.append((LOOKUP, r, key))
                if result is LookupResult.MISS:
                    break
                hits += 1
            ready = [k for k in keys[:hits] if store.lookup(k) is LookupResult.HIT]
            ready = ready[: len(ready) // groups * groups]
            if ready:
                ops.append((LOAD, r, ready))
                store.prepare_load(ready, ctx)
                jobs.append((LOAD, r, ready))
            running[r] = len(ready)
        if not running:
            break
        for r, start in list(running.items()):
            keys = requests[r][start : start + step_chunks]
            ops.append((STORE, r, keys))
            out = store.prepare_store(keys, contexts[r])
            if out is not None and out.keys_to_store:
                jobs.append((STORE, r, list(out.keys_to_store)))
            running[r] = start + len(keys)
        for r in [r for r, start in running.items() if start >= len(requests[r])]:
            ops.append((FINISH, r, None))
            store.on_request_finished(contexts[r])
            del running[r]
        ops.append((EVENTS, -1, None))
        store.take_events()
        ops.append((STATS, -1, None))
        store.get_stats()
    return ops


# --- replays ---


def _drain(take_events: Callable[[], Any]) -> None:
    for _ in take_events():
        pass


def bind_vllm(manager: Any, ops: list, contexts: list) -> list[tuple[Callable, tuple]]:
    """`(method, args)` per call of the trace, through vLLM's interface."""
    m = manager
    table = {
        LOOKUP: m.lookup,
        LOAD: m.prepare_load,
        DONE_LOAD: m.complete_load,
        STORE: m.prepare_store,
        DONE_STORE: m.complete_store,
        NEW: m.on_new_request,
        FINISH: m.on_request_finished,
    }
    calls: list[tuple[Callable, tuple]] = []
    for op, r, payload in ops:
        if op == EVENTS:
            calls.append((_drain, (m.take_events,)))
        elif op == STATS:
            calls.append((m.get_stats, ()))
        elif op == FAIL_STORE:
            calls.append((m.complete_store, (payload, contexts[r], False)))
        elif payload is None:
            calls.append((table[op], (contexts[r],)))
        else:
            calls.append((table[op], (payload, contexts[r])))
    return calls


def bind_ours(store: HostStore, ops: list, contexts: list) -> list[tuple[Callable, tuple]]:
    """The same calls on our own API (`complete_store(keys, success, ctx)`)."""
    s = store
    table = {
        LOOKUP: s.lookup,
        LOAD: s.prepare_load,
        DONE_LOAD: s.complete_load,
        STORE: s.prepare_store,
        NEW: s.on_new_request,
        FINISH: s.on_request_finished,
    }
    calls: list[tuple[Callable, tuple]] = []
    for op, r, payload in ops:
        if op == EVENTS:
            calls.append((s.take_events, ()))
        elif op == STATS:
            calls.append((s.get_stats, ()))
        elif op in (DONE_STORE, FAIL_STORE):
            calls.append((s.complete_store, (payload, op == DONE_STORE, contexts[r])))
        elif payload is None:
            calls.append((table[op], (contexts[r],)))
        else:
            calls.append((table[op], (payload, contexts[r])))
    return calls


# CPU time of this process: on a shared machine the wall clock also counts the time
# other processes held the CPU, which is noise here (the code under test is
# single-threaded and does no I/O).
CLOCK = time.process_time


def replay(calls: list[tuple[Callable, tuple]]) -> float:
    clock = CLOCK
    start = clock()
    for fn, args in calls:
        fn(*args)
    return clock() - start


class Impl:
    """One manager implementation: builds fresh instances and contexts per repeat."""

    def __init__(self, name: str, api: str, make: Callable, context: Callable, bind: Callable):
        self.name, self.api = name, api
        self._make, self._context, self._bind = make, context, bind

    def fresh(self, ops: list, requests: list[list[bytes]], groups: int):
        contexts = []
        for i, keys in enumerate(requests):
            ctx = self._context(str(i))
            setter = getattr(ctx, "set_offload_key_position", None) or ctx.set_key_position
            for j, key in enumerate(keys):
                setter(key, (j // groups + 1) * TOKENS_PER_CHUNK)
            contexts.append(ctx)
        manager = self._make()
        return manager, self._bind(manager, ops, contexts), contexts


def implementations(num_chunks: int, policy: str) -> list[Impl]:
    impls = [
        Impl(
            "HostStore",
            "own",
            lambda: HostStore(num_chunks, eviction_policy=policy, enable_events=True),
            RequestContext,
            bind_ours,
        )
    ]
    try:
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        from jax_kvoffload.bridge._vllm_manager import build_manager_class
    except ImportError:
        return impls
    manager_cls = build_manager_class()
    impls += [
        Impl(
            "vLLM CPUOffloadingManager",
            "vllm",
            lambda: CPUOffloadingManager(num_chunks, cache_policy=policy, enable_events=True),
            ReqContext,
            bind_vllm,
        ),
        Impl(
            "JaxOffloadingManager",
            "vllm",
            lambda: manager_cls(HostStore(num_chunks, eviction_policy=policy, enable_events=True)),
            ReqContext,
            bind_vllm,
        ),
    ]
    return impls


def _comparable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if hasattr(value, "name"):  # LookupResult (either)
        return value.name
    if hasattr(value, "block_ids"):  # CPULoadStoreSpec
        return value.block_ids.tolist()
    if hasattr(value, "keys_to_store"):  # PrepareStoreOutput (either)
        ids = getattr(value, "chunk_ids", None)
        ids = list(ids) if ids is not None else value.store_spec.block_ids.tolist()
        return (list(value.keys_to_store), ids, list(value.evicted_keys))
    if isinstance(value, tuple):  # our prepare_load
        return list(value)
    return None  # events, stats: compared by the differential tests


def check_same_answers(impls: list[Impl], ops: list, requests: list, groups: int) -> None:
    """One untimed replay per implementation: every answer must be equal."""
    answers = []
    for impl in impls:
        _, calls, _ = impl.fresh(ops, requests, groups)
        answers.append([_comparable(fn(*args)) for fn, args in calls])
    for impl, got in zip(impls[1:], answers[1:], strict=True):
        if got != answers[0]:
            i = next(i for i, (a, b) in enumerate(zip(got, answers[0])) if a != b)
            raise SystemExit(f"error: {impl.name} answers call #{i} differently")


def lookup_keys(requests: list[list[bytes]], rng: random.Random, n: int) -> list[bytes]:
    keys = [k for keys in requests[-200:] for k in keys]
    return [rng.choice(keys) for _ in range(n)]


def time_lookups(manager: Any, ctx: Any, keys: list[bytes]) -> float:
    """CPU seconds per `lookup` over `keys` (after one untimed pass)."""
    lookup = manager.lookup
    for key in keys:
        lookup(key, ctx)
    start = CLOCK()
    for key in keys:
        lookup(key, ctx)
    return (CLOCK() - start) / len(keys)


# --- output ---

COLUMNS = (
    _report.Col("policy", "policy", text=True),
    _report.Col("impl", "implementation", text=True),
    _report.Col("api", "interface", text=True),
    _report.Col("calls", "calls"),
    _report.Col("trace_s", "trace", "ms", 1),
    _report.Col("s_per_call", "per call", "µs", 3),
    _report.Col("speedup", "x vLLM", "x"),
    _report.Col("lookups_per_s", "lookups", "M/s"),
    _report.Col("lookup_speedup", "x vLLM", "x"),
)


def print_table(rows: list[dict[str, Any]]) -> None:
    # Without vLLM the "x vLLM" cells are None: the table shows "-".
    print(_report.table(rows, COLUMNS))


def write_outputs(
    rows: list[dict[str, Any]], meta: dict[str, Any], info: dict[str, Any], out: pathlib.Path
) -> None:
    _report.write_csv(out / "manager.csv", [c.key for c in COLUMNS], rows)
    plot(rows, meta, info, out / "manager.png")


def plot(
    rows: list[dict[str, Any]], meta: dict[str, Any], info: dict[str, Any], path: pathlib.Path
) -> None:
    """One question: how much faster than vLLM's manager are ours on the same calls (x)?"""
    plt = _report.pyplot()
    if plt is None:
        return
    policies = sorted({r["policy"] for r in rows})
    series = [
        ("JaxOffloadingManager", "ours through vLLM's interface"),
        ("HostStore", "ours, own API"),
    ]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    width = 0.38
    for i, (impl, label) in enumerate(series):
        values = [
            next((r["speedup"] for r in rows if r["policy"] == p and r["impl"] == impl), 0.0) or 0.0
            for p in policies
        ]
        xs = [j + (i - 0.5) * width for j in range(len(policies))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, fmt="%.2fx", padding=2, fontsize=8)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="vLLM 0.33.0 (1x)")
    ax.axhline(2.0, color="gray", linewidth=1, linestyle=":", label="target (2x)")
    calls = {r["policy"]: r["calls"] for r in rows}
    ax.set_xticks(range(len(policies)), [f"{p.upper()}\n{calls[p]:,} calls" for p in policies])
    ax.set_ylabel("speed vs vLLM's manager (x, higher is faster)")
    ax.set_title(
        f"Manager calls on one trace of {meta['requests']:,} requests (median of "
        f"{meta['repeats']}, CPU time)\nmeasured {_report.measured_on(info)}",
        fontsize=9,
    )
    ax.legend(loc="upper left", fontsize=8, frameon=False, ncols=2)
    ax.set_ylim(0, max([r["speedup"] or 0 for r in rows] + [2.0]) * 1.3)
    fig.tight_layout()
    _report.save(fig, path)


def run_policy(
    policy: str, args: argparse.Namespace, requests: list, progress: Callable
) -> list[dict]:
    rng = random.Random(args.seed + 1)
    ops = record_trace(
        requests,
        args.chunks,
        policy,
        groups=args.groups,
        concurrency=args.concurrency,
        chunks_per_step=args.chunks_per_step,
        failure_rate=0.01,
        rng=rng,
    )
    impls = implementations(args.chunks, policy)
    check_same_answers(impls, ops, requests, args.groups)
    times: dict[str, list[float]] = {impl.name: [] for impl in impls}
    lookups: dict[str, list[float]] = {impl.name: [] for impl in impls}
    keys = lookup_keys(requests, rng, 20_000)
    for rep in range(args.repeats):
        progress(f"{policy}: repeat {rep + 1}/{args.repeats}")
        order = impls if rep % 2 == 0 else impls[::-1]  # alternate who goes first
        for impl in order:
            manager, calls, contexts = impl.fresh(ops, requests, args.groups)
            times[impl.name].append(replay(calls))
            lookups[impl.name].append(time_lookups(manager, contexts[-1], keys))
    vllm = "vLLM CPUOffloadingManager"
    base = statistics.median(times[vllm]) if vllm in times else None
    base_lookup = statistics.median(lookups[vllm]) if vllm in times else None
    rows = []
    for impl in impls:
        t = statistics.median(times[impl.name])
        lk = statistics.median(lookups[impl.name])
        rows.append(
            {
                "policy": policy,
                "impl": impl.name,
                "api": impl.api,
                "calls": len(ops),
                "trace_s": t,
                "s_per_call": t / len(ops),
                "speedup": base / t if base else None,
                "lookups_per_s": 1 / lk,
                "lookup_speedup": base_lookup / lk if base_lookup else None,
            }
        )
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    at_least_1 = _report.int_at_least(1)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the default: 1,500 requests")
    size.add_argument("--full", action="store_true", help="20,000 requests (~0.5M calls; minutes)")
    parser.add_argument("--requests", type=at_least_1, help="requests in the trace")
    parser.add_argument("--prefixes", type=at_least_1, default=300, help="shared prefixes")
    parser.add_argument(
        "--zipf", type=_report.positive_float, default=1.1, help="prefix popularity skew"
    )
    parser.add_argument("--chunks", type=at_least_1, default=2_000, help="host store capacity")
    parser.add_argument("--groups", type=at_least_1, default=1, help="KV-cache groups")
    parser.add_argument("--concurrency", type=at_least_1, default=8, help="requests in flight")
    parser.add_argument("--chunks-per-step", type=at_least_1, default=4, help="offered per step")
    parser.add_argument("--repeats", type=at_least_1, default=5, help="timed replays (median)")
    parser.add_argument("--policies", nargs="+", choices=("lru", "arc"), default=["lru", "arc"])
    parser.add_argument("--seed", type=int, default=0)
    _report.add_output_args(parser, pathlib.Path(__file__).parent / "results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    num_requests = args.requests or (20_000 if args.full else 1_500)
    requests = make_requests(
        num_requests, args.prefixes, args.zipf, args.groups, random.Random(args.seed)
    )
    progress = _report.Progress(len(args.policies) * args.repeats, quiet=args.quiet)
    rows = []
    for policy in args.policies:
        rows += run_policy(policy, args, requests, progress.step)
    progress.finish()
    info = _report.machine()
    meta = {
        "requests": num_requests,
        "calls": rows[0]["calls"],
        "chunks": args.chunks,
        "repeats": args.repeats,
        "vllm": any(r["impl"].startswith("vLLM") for r in rows),
    }
    note = (
        f"one recorded trace of {num_requests:,} requests, {args.chunks:,} host chunks; "
        f"medians of {args.repeats} alternating replays (CPU time). x vLLM: vLLM's time / "
        "this time for the same calls (>1 = faster); lookups: lookup alone, on the state "
        "the trace left"
    )
    if not meta["vllm"]:
        note += ". vLLM is not importable: only our own API runs (no comparison)"
    _report.emit("manager", args, [("", rows, COLUMNS)], rows, note=note, info={**info, **meta})
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
        write_outputs(rows, meta, info, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
