"""Our LRU and ARC policies inside vLLM 0.33.0's own `CPUOffloadingManager`.

They implement vLLM's `CachePolicy` interface (vLLM's `ReqContext` and `ChunkStatus`
in), so the bridge declares them virtual subclasses of it, and vLLM's
`CachePolicyFactory` (which asserts `issubclass(cls, CachePolicy)`) loads them by
module path: `"eviction_policy": "LRUPolicy", "cache_policy_module_path":
"jax_kvoffload.bridge.vllm"` in vLLM's own CPU spec. Hosted there, they must decide
exactly as vLLM's: random scheduler traces (`_manager_traces.py`) run on vLLM's manager
with our policy and on vLLM's manager with vLLM's policy of the same kind, and every
answer (lookups, chunk ids, evicted keys, events, stats, ARC's target) must be equal.

Sizes: `JKO_HOSTED_POLICY_TRACES` (default 60); replay one seed with
`JKO_HOSTED_POLICY_SEED=<seed>` (printed by a failure).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed")

from vllm.v1.kv_offload.cpu.policies.base import CachePolicy
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from jax_kvoffload import store
from jax_kvoffload.bridge import vllm as bridge

from . import _manager_traces as traces

pytestmark = pytest.mark.vllm

NUM_TRACES = int(os.environ.get("JKO_HOSTED_POLICY_TRACES", "60"))
REPLAY = os.environ.get("JKO_HOSTED_POLICY_SEED")
SEEDS = [int(REPLAY)] if REPLAY else list(range(1000, 1000 + NUM_TRACES))
OURS = {"lru": "LRUPolicy", "arc": "ARCPolicy"}


def test_vllms_factory_loads_our_policies_by_module_path():
    for name in OURS.values():
        cls = CachePolicyFactory.get_cache_policy_cls(name, "jax_kvoffload.bridge.vllm")
        assert cls is getattr(store, name) is getattr(bridge, name)
        assert issubclass(cls, CachePolicy)


class HostedTwins(traces.Twins):
    """vLLM's CPU spec's manager twice: hosting our policy, and vLLM's own."""

    def __init__(self, cfg: traces.TraceConfig, coverage: collections.Counter | None = None):
        super().__init__(cfg, coverage)
        extra = cfg.offloading_config().extra_config
        ours = {
            **extra,
            "eviction_policy": OURS[cfg.policy],
            "cache_policy_module_path": "jax_kvoffload.bridge.vllm",
        }
        self.ours = CPUOffloadingSpec(
            dataclasses.replace(cfg.offloading_config(), extra_config=ours)
        ).get_manager()
        self.policies = (self.ours._policy, self.theirs._policy)
        assert type(self.policies[0]) is getattr(store, OURS[cfg.policy])
        assert type(self.policies[1]).__name__ == f"{cfg.policy.upper()}CachePolicy"
        self.coverage[f"policy {OURS[cfg.policy]}"] += 1

    def fail(self, message: str) -> None:
        try:
            super().fail(message)
        except traces.Divergence as exc:
            replay = (
                f"JKO_HOSTED_POLICY_SEED={self.cfg.seed} "
                "python -m pytest -q tests/bridge/test_vllm_hosts_our_policies.py"
            )
            raise traces.Divergence(str(exc).split("replay: ")[0] + "replay: " + replay) from None

    def _check_our_metrics(self, method, out):
        """Both are vLLM's managers: neither sends the plug-in's own metrics."""


def _draw(seed: int) -> traces.TraceConfig:
    """A trace of the shared generator, with vLLM's built-in LRU or ARC."""
    cfg = traces.TraceConfig.draw(seed)
    policy = random.Random(seed).choice(sorted(OURS))
    return dataclasses.replace(cfg, policy=policy, cache_policy_module_path=None)


def test_random_traces_decide_as_vllms_own_policies(monkeypatch):
    monkeypatch.setattr(traces, "Twins", HostedTwins)  # what TraceRunner drives
    # Both sides are vLLM's manager, so a misused protocol fails alike (vLLM asserts).
    monkeypatch.setattr(
        traces,
        "error_family",
        lambda exc, ours: "protocol" if isinstance(exc, AssertionError) else repr(exc),
    )
    coverage: collections.Counter = collections.Counter()
    for seed in SEEDS:
        traces.TraceRunner(_draw(seed), coverage).run()
    print(dict(coverage))
    if not REPLAY:
        reached = {
            k: coverage[k]
            for k in (
                "policy LRUPolicy",
                "policy ARCPolicy",
                "prepare_store evicted",
                "prepare_store None",
                "complete_store failed",
                "lookup HIT",
                "on_request_finished",
                "arc target moved",
            )
        }
        assert all(reached.values()), f"the traces no longer reach {reached}"
