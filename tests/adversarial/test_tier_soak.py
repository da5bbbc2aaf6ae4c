"""Randomized soak of `KVOffloader` with a secondary tier, against the fault suite's
model (a block's bytes are a function of its hash).

The offloader's lives share one tier, so each new life finds what earlier ones stored;
a tiny host store (3-8 chunks) makes promotions evict and cascades pin. On top of the
soak's steps (stores, lookups + loads, polls, waits, resets, closes, interrupts at any
caller-side call of the tier path included, worker failures, slow copies): asynchronous
lookups whose promotions finish in the background, `flush_tiers`, and tier faults (keys
lost after `contains` said yes, a tier job raising, stores dropped, loads held back).
Checked: every block a successful load reports holds `content(hash)` (zero corrupted
bytes), every job reported exactly once, no pin or write-pending chunk after a drain,
no tier job left, no thread or descriptor leaked.

CI size: JAX_KVOFFLOAD_TIER_SOAK_STEPS (default 300) for each seed of
JAX_KVOFFLOAD_TIER_SOAK_SEEDS (default 0,1).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

import numpy as np
import pytest

from tests.faults._helpers import (
    CALLER_TARGETS,
    Injector,
    WorkerFaults,
    config,
    hashes,
    interruptible,
    offloader,
    pins,
)
from tests.faults._tiers import FakeTier
from tests.faults.test_soak import OPS, WEIGHTS, Soak

STEPS = int(os.environ.get("JAX_KVOFFLOAD_TIER_SOAK_STEPS", "300"))
SEEDS = [int(s) for s in os.environ.get("JAX_KVOFFLOAD_TIER_SOAK_SEEDS", "0,1").split(",")]
TARGETS = [*CALLER_TARGETS, (FakeTier, "contains"), (FakeTier, "submit_store"),
           (FakeTier, "submit_load")]  # fmt: skip
TIER_OPS = ["async_lookup", "flush", "lose", "tier_raises", "drop", "hold_loads"]
TIER_WEIGHTS = [8, 3, 3, 1, 1, 2]


class TierSoak(Soak):
    def __init__(self, seed: int, monkeypatch) -> None:
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.tier = FakeTier()
        self.injector = Injector(monkeypatch, TARGETS)
        self.faults = WorkerFaults(monkeypatch)
        self.stats: Counter[str] = Counter()
        self.corrupted_bytes = 0
        self.window = None if seed % 2 == 0 else int(self.rng.integers(1, 4)) * 2 * 4
        self.prompts = [hashes(f"t{seed}-{i}", int(self.rng.integers(2, 11))) for i in range(10)]
        self.off = None
        self.recent: list[list[bytes]] = []
        self.open()

    def open(self) -> None:
        cfg = config(chunks=int(self.rng.integers(3, 9)), window=self.window)
        self.off = offloader(cfg, seed=int(self.rng.integers(1 << 30)), tiers=[self.tier])
        self.window_blocks = (
            None if self.window is None else cfg.groups[0].sliding_window_size_in_chunks * 2
        )
        from tests.faults._helpers import Reports

        self.reports = Reports()
        self.loads: dict[int, tuple[list[int], list[bytes]]] = {}
        self.busy: set[int] = set()

    def close(self) -> None:
        super().close()
        assert self.off._tiers.in_flight == 0, f"seed {self.seed}: tier jobs left"
        (t,) = self.off.tier_stats
        self.stats["promoted"] += t.promoted
        self.stats["cascaded"] += t.cascaded

    def step(self, op: str) -> None:
        off, rng, tier = self.off, self.rng, self.tier
        if op == "async_lookup":
            h = self.prompts[int(rng.integers(len(self.prompts)))]
            with interruptible():
                off.lookup(h, wait=False)
                self.stats["async lookups"] += 1
        elif op == "flush":
            with interruptible():
                assert off.flush_tiers(timeout=30), f"seed {self.seed}: a tier job hung"
        elif op == "lose":  # contains() says yes, the load misses (evicted meanwhile)
            keys = list(tier.entries)
            if keys:
                tier.lost.add(keys[int(rng.integers(len(keys)))])
                self.stats["keys lost"] += 1
        elif op == "tier_raises":
            tier.load_raises = OSError("tier I/O")
            threading.Timer(0.02, setattr, (tier, "load_raises", None)).start()
        elif op == "drop":
            tier.drop_stores = not tier.drop_stores
        elif op == "hold_loads":
            gate = threading.Event()
            tier.load_gate = gate
            threading.Timer(float(rng.uniform(0.005, 0.05)), gate.set).start()
        else:
            super().step(op)

    def run(self, steps: int) -> None:
        ops = [*OPS, *TIER_OPS]
        weights = np.array([*WEIGHTS, *TIER_WEIGHTS], dtype=float)
        for _ in range(steps):
            self.step(str(self.rng.choice(ops, p=weights / weights.sum())))
            if self.injector.fired:
                self.stats["interrupts"] += 1
                self.injector.disarm()
                self.injector.fired = None
        self.injector.disarm()
        self.faults.arm(None, 0)
        self.faults.slow_down(0.0, 0)
        self.tier.load_gate = None
        self.handle(self.off.wait())
        assert self.off.flush_tiers(timeout=30)
        assert pins(self.off) == (0, 0)
        self.close()


# What the seeds above exercised, together (checked by the test after them).
COVERAGE: Counter = Counter()


@pytest.mark.slow  # a soak
@pytest.mark.parametrize("seed", SEEDS)
def test_tier_soak(monkeypatch, seed):
    started = time.perf_counter()
    soak = TierSoak(seed, monkeypatch)
    try:
        soak.run(STEPS)
    finally:
        soak.tier.load_gate = None
        soak.tier.close()
    stats = dict(sorted(soak.stats.items()))
    print(f"tier soak seed={seed} steps={STEPS} {time.perf_counter() - started:.1f}s {stats}")
    assert soak.corrupted_bytes == 0, f"seed {seed}: {soak.corrupted_bytes} corrupted bytes"
    COVERAGE.update(soak.stats)
    assert soak.stats["blocks verified"] > 0, f"seed {seed}: no load verified a block"


@pytest.mark.slow  # reads what the soaks above recorded
def test_the_soaks_promoted_from_the_tier():
    """Over all seeds, lookups promoted from the tier. One seed alone may draw none (the
    timing of asynchronous lookups decides: seed 1 drew none once in ten runs here);
    every seed drawing none means the soak no longer reaches the promotion path."""
    if not COVERAGE:
        pytest.skip("no soak ran in this session (this test was selected alone)")
    assert COVERAGE["promoted"] > 0, dict(COVERAGE)
