"""`JaxOffloadingSpec` with secondary tiers against vLLM 0.33.0's `TieringOffloadingSpec`
on random call traces (skipped unless vLLM is importable).

Both specs build vLLM's own `TieringOffloadingManager` over vLLM's in-memory `example`
tier (synchronous, deterministic); the primary tier is our `HostStore`
(`JaxPrimaryTier`) on one side and vLLM's `CPUPrimaryTierOffloadingManager` on the
other. The traces of `_manager_traces.py` (vLLM's scheduler keys, prefix-sharing
prompts, loads, stores, failures, events, stats, resets) run on both, plus the tiering
calls: `on_schedule_end` (promotions flushed, tier jobs processed) and
`on_reset_flushed`. Every answer must be equal: lookups (HIT / HIT_PENDING / RETRY /
MISS: the cascade and promotion decisions), chunk ids, evicted keys, events, vLLM's
tiering metrics. A difference names the seed: `JKO_TIERING_DIFF_SEED=<seed>`.
Sizes: `JKO_TIERING_DIFF_TRACES` (default 60, a few seconds).
"""

from __future__ import annotations

import collections
import dataclasses
import os

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed")

from vllm.v1.kv_offload import base
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from jax_kvoffload.bridge import vllm as bridge

from . import _manager_traces as traces

pytestmark = pytest.mark.vllm

NUM_TRACES = int(os.environ.get("JKO_TIERING_DIFF_TRACES", "60"))
REPLAY = os.environ.get("JKO_TIERING_DIFF_SEED")
SEEDS = [int(REPLAY)] if REPLAY else list(range(NUM_TRACES))


def _config(cfg: traces.TraceConfig, seed: int):
    out = cfg.offloading_config()
    extra = {**out.extra_config, "secondary_tiers": [{"type": "example"}]}
    # A region name per trace and side: the two primaries must not share host rows.
    return dataclasses.replace(out, extra_config=extra, engine_id=f"tdiff-{os.getpid()}-{seed}")


class TieredTwins(traces.Twins):
    """vLLM's tiering manager over our store, and over vLLM's CPU primary tier."""

    def __init__(self, cfg: traces.TraceConfig, coverage: collections.Counter):
        ours = bridge.JaxOffloadingSpec(_config(cfg, 2 * cfg.seed))
        theirs = TieringOffloadingSpec(_config(cfg, 2 * cfg.seed + 1))
        self.ours, self.theirs = ours.get_manager(), theirs.get_manager()
        assert type(self.ours) is TieringOffloadingManager is type(self.theirs)
        self.cfg = cfg
        self.log = []
        self.coverage = coverage
        self.policies = (self.ours.primary_tier.store.policy, self.theirs.primary_tier._policy)
        self.recorded = isinstance(self.policies[1], traces._Recorder)
        self.expected = collections.Counter()
        self.reported = collections.Counter()
        coverage["traces"] += 1

    def call(self, method, *args, req=None, **kw):
        if method == "get_stats":
            return self._stats()
        try:
            return super().call(method, *args, req=req, **kw)
        except traces.Divergence as e:
            if "errors differ" not in str(e):
                raise
            # vLLM's tiering code runs on both sides: its own errors (a KeyError for a
            # request it finalized) are the same exception on both.
            raise traces._Stop from None if _same_tiering_error(str(e)) else e

    def _stats(self):
        """vLLM's metrics of both, timings reduced to their sample counts."""
        self.log.append(("get_stats", (), None))
        got = []
        for m in (self.ours, self.theirs):
            stats = m.get_stats()
            data = {} if stats is None else stats.data["data"]
            got.append({
                name: {k: _untimed(name, v) for k, v in values.items()}
                for name, values in data.items() if not name.startswith("vllm:kv_offload_jax_")
            })  # fmt: skip
        if got[0] != got[1]:
            self.fail(f"get_stats answers differ:\n  ours:  {got[0]}\n  vLLM:  {got[1]}")
        self.coverage["get_stats"] += 1
        return None

    def _check_our_metrics(self, method, out):
        pass  # our per-chunk metrics are the primary's; compared without tiers elsewhere

    def close(self):
        for m in (self.ours, self.theirs):
            m.shutdown()


def _untimed(name: str, value):
    """A timing (a histogram's samples, a summed time) as what is not timing-dependent:
    the number of samples, or whether any time was summed."""
    if not name.endswith(("_seconds", "_time")):
        return value
    return len(value) if isinstance(value, list) else value > 0


def _same_tiering_error(message: str) -> bool:
    ours, _, theirs = message.partition("ours ")[2].partition(", vLLM ")
    return ours.split("(")[0] == theirs.split("(")[0] and ours.split("(")[0] == "KeyError"


class TieredRunner(traces.TraceRunner):
    def __init__(self, cfg: traces.TraceConfig, coverage: collections.Counter):
        self.cfg = cfg
        self.rng = traces.random.Random(cfg.seed * 7919 + 1)
        self.twins = TieredTwins(cfg, coverage)
        self.sched = cfg.scheduler_config()
        self.prompts = [[self._hash() for _ in range(self.rng.randint(8, 40))] for _ in range(4)]
        self.requests, self.loads, self.stores = [], [], []
        self.next_req = 0
        self.misuse = 0.0
        self.new_ids: list[str] = []

    def new_request(self):
        before = len(self.requests)
        super().new_request()
        if len(self.requests) > before:
            req = self.requests[-1]
            if req.req.request_id not in [r for m, _, r in self.twins.log if m == "on_new_request"]:
                self.twins.call("on_new_request", req=req)  # the tiering manager needs it
            self.new_ids.append(req.req.request_id)

    def schedule_end(self):
        ctx = base.ScheduleEndContext(tuple(self.new_ids), ())
        self.new_ids = []
        pending = self.twins.theirs._pending_load_submissions
        self.twins.coverage["promotions flushed"] += sum(
            len(e.keys) for by_req in pending.values() for e in by_req.values()
        )
        self.twins.call("on_schedule_end", ctx)

    def reset_flushed(self):
        self.twins.call("on_reset_flushed")

    def lone_call(self):
        pass

    def run(self):
        ops = [
            (self.new_request, 3),
            (self.grow, 2),
            (self.lookup_and_load, 6),
            (self.complete_load, 4),
            (self.touch, 2),
            (self.store, 8),
            (self.complete_store, 7),
            (self.schedule_end, 5),
            (self.take_events, 2),
            (self.stats, 1),
            (self.finish, 3),
            (self.reset, 0.25),
            (self.reset_flushed, 0.5),
        ]
        funcs, weights = zip(*ops)
        try:
            while len(self.twins.log) < self.cfg.num_calls:
                self.rng.choices(funcs, weights)[0]()
            self.take_events()
            self.stats()
        except traces._Stop:
            pass
        finally:
            self.twins.close()
        return len(self.twins.log)

    def _lookup(self, req, key):
        result = self.twins.call("lookup", key, req=req)
        self.twins.coverage[f"lookup {result.name}"] += 1
        return result


def _draw(seed: int) -> traces.TraceConfig:
    cfg = traces.TraceConfig.draw(seed)
    # vLLM's TieringOffloadingSpec refuses store_threshold >= 2; shorter traces.
    return dataclasses.replace(
        cfg, store_threshold=min(cfg.store_threshold, 1), num_calls=cfg.num_calls // 2
    )


def test_random_traces_tier_like_vllm():
    coverage: collections.Counter = collections.Counter()
    for seed in SEEDS:
        TieredRunner(_draw(seed), coverage).run()
    print(dict(coverage))
    if not REPLAY and NUM_TRACES >= 40:
        for outcome in ("lookup HIT", "promotions flushed", "on_reset_flushed", "reset_cache"):
            assert coverage[outcome] > 0, (outcome, coverage)
