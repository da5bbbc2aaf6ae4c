"""Our manager against vLLM 0.33.0's `CPUOffloadingManager` on random call traces.

Both are built from one vLLM `OffloadingConfig` by their specs and driven through vLLM's
`OffloadingManager` interface with vLLM's own `ReqContext`s, keyed by vLLM's scheduler
code (`_manager_traces.py`). Each trace (seeded) interleaves lookup / get_load_source /
prepare_load / touch / complete_load / prepare_store / complete_store (success and
failure) / take_events / get_stats / reset_cache / on_new_request /
on_request_finished over 1-3 groups (sliding-window ones included), 1-4 blocks per
chunk, 4-32 chunks, LRU or ARC, store thresholds 0-3 and small reuse trackers, events
on. Every answer (chunk ids, evicted keys, events, stats, error family) must be equal;
a third of the traces run a vLLM-style policy (registered with vLLM's
`CachePolicyFactory`, or loaded by `cache_policy_module_path`) whose hook calls must be
equal too.

Sizes: `JKO_MANAGER_DIFF_TRACES` (default 300, about 10 s); replay one seed with
`JKO_MANAGER_DIFF_SEED=<seed>` (printed by a failure).
"""

from __future__ import annotations

import collections
import os

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed")

from ._manager_traces import TraceConfig, TraceRunner

pytestmark = pytest.mark.vllm

NUM_TRACES = int(os.environ.get("JKO_MANAGER_DIFF_TRACES", "300"))
REPLAY = os.environ.get("JKO_MANAGER_DIFF_SEED")
SEEDS = [int(REPLAY)] if REPLAY else list(range(NUM_TRACES))
SHARDS = 1 if REPLAY else 4

# What the traces must reach, per shard of ~75 traces (measured: several times more).
MIN_COVERAGE = {
    "prepare_store evicted": 60,
    "prepare_store None": 30,
    "prepare_store nothing to store": 60,
    "complete_store failed": 30,
    "metadata-only events": 30,
    "lookup HIT_PENDING": 100,
    "lookup HIT": 200,
    "reset_cache": 10,
    "stores skipped": 10,
    "policy hook calls": 500,
    "on_request_finished": 100,
    "arc target moved": 3,
}


@pytest.mark.parametrize("shard", range(SHARDS))
def test_random_traces_answer_like_vllm(shard):
    coverage: collections.Counter = collections.Counter()
    for seed in SEEDS[shard::SHARDS]:
        TraceRunner(TraceConfig.draw(seed), coverage).run()
    print(f"shard {shard}: {dict(coverage)}")
    if not REPLAY and NUM_TRACES >= 200:
        missing = {k: coverage[k] for k, n in MIN_COVERAGE.items() if coverage[k] < n}
        assert not missing, f"the traces no longer reach {missing}"
        # Both error paths and vLLM-style policies must have been exercised.
        assert any(k.endswith(" error") for k in coverage), coverage
        assert (
            coverage["policy RecordingLRUCachePolicy"]
            and coverage["policy RecordingARCCachePolicy"]
        )
