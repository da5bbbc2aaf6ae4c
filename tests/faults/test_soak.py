"""Randomized soak: thousands of mixed steps against a trivially correct model.

Steps: store, lookup + load, poll, wait (sometimes with a bad id), reset_cache, close
and reopen, an interrupt armed at a random upcoming caller-side call (KeyboardInterrupt
instead of the call, or a real SIGINT right after it), a failure armed in the worker
threads, and slow worker copies (so that jobs stay in flight across resets and later
stores). The model: a block's bytes are a function of its hash (as in a real
engine), so whatever a load reports as success must hold `content(hash)` for every
block it loaded, whatever happened before. Checked: corrupted bytes = 0, every job id
reported exactly once, no pin or write-pending chunk left after a drain, caches never
lost to a donation, no thread left (conftest).

CI size: JAX_KVOFFLOAD_SOAK_STEPS (default 750) steps for each seed of
JAX_KVOFFLOAD_SOAK_SEEDS (default 0-3); replay one with
`JAX_KVOFFLOAD_SOAK_SEEDS=7 pytest tests/faults/test_soak.py -s`.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import numpy as np
import pytest

from jax_kvoffload.errors import KVOffloadError
from tests.faults._helpers import (
    NB,
    Injector,
    Reports,
    WorkerFaults,
    blocks,
    config,
    expected,
    hashes,
    interruptible,
    offloader,
    pins,
    write_blocks,
)

STEPS = int(os.environ.get("JAX_KVOFFLOAD_SOAK_STEPS", "750"))
SEEDS = [int(s) for s in os.environ.get("JAX_KVOFFLOAD_SOAK_SEEDS", "0,1,2,3").split(",")]
OPS = ["store", "load", "poll", "wait", "bad_wait", "reset", "close", "interrupt", "fault", "slow"]
WEIGHTS = np.array([30, 30, 10, 6, 2, 4, 1, 6, 2, 8], dtype=float)
ERRORS = [OSError("io"), MemoryError("host"), KeyboardInterrupt(), SystemExit(1)]


class Soak:
    def __init__(self, seed: int, monkeypatch) -> None:
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.injector = Injector(monkeypatch)
        self.faults = WorkerFaults(monkeypatch)
        self.stats: Counter[str] = Counter()
        self.corrupted_bytes = 0
        bpc = 2
        self.window = None if seed % 2 == 0 else int(self.rng.integers(1, 4)) * bpc * 4
        self.prompts = [hashes(f"s{seed}-{i}", int(self.rng.integers(2, 11))) for i in range(12)]
        self.off = None
        self.recent: list[list[bytes]] = []
        self.open()

    # -- the offloader's lives --------------------------------------------------------

    def open(self) -> None:
        cfg = config(chunks=int(self.rng.integers(3, 12)), window=self.window)
        self.off = offloader(cfg, seed=int(self.rng.integers(1 << 30)))
        self.window_blocks = (
            None if self.window is None else cfg.groups[0].sliding_window_size_in_chunks * 2
        )
        self.reports = Reports()
        self.loads: dict[int, tuple[list[int], list[bytes]]] = {}
        self.busy: set[int] = set()  # targets of loads not yet reported

    def close(self) -> None:
        for _ in range(5):  # an armed interrupt may hit close; it is then called again
            with interruptible():
                self.handle(self.off.close())
            if self.off.closed:
                break
        with self.injector.paused():
            self.handle(self.off.close())  # what an interrupted close could not return
            assert self.off.closed
            self.reports.check_exactly_once(f"seed {self.seed}")
            assert pins(self.off) == (0, 0), f"seed {self.seed}"
            assert not any(a.is_deleted() for a in self.off.caches())

    # -- model checks -----------------------------------------------------------------

    def handle(self, results) -> None:
        with self.injector.paused():
            self.reports.record(results or [])
            for r in results or []:
                self.stats["ok" if r.success else "failed"] += 1
                if r.job_id not in self.loads:
                    continue
                dst, hh = self.loads.pop(r.job_id)
                self.busy -= set(dst)
                if not r.success:
                    continue
                start = 0 if self.window_blocks is None else max(0, len(hh) - self.window_blocks)
                got, want = blocks(self.off, dst[start:]), expected(hh[start:])
                self.corrupted_bytes += int(np.sum(got != want)) * got.itemsize
                self.stats["blocks verified"] += len(hh) - start

    # -- steps ------------------------------------------------------------------------

    def step(self, op: str) -> None:
        off, rng = self.off, self.rng
        if op == "store":
            h = self.prompts[int(rng.integers(len(self.prompts)))]
            free = sorted(set(range(NB)) - self.busy)
            if len(free) < len(h):
                return
            src = [int(b) for b in rng.choice(free, len(h), replace=False)]
            with self.injector.paused():
                write_blocks(off, src, h)  # the engine's prefill: blocks hold content(h)
            with interruptible() as caught:
                job = self.reports.issue(off.store(h, src))
                self.stats["stores" if job is not None else "offers dropped"] += 1
                self.recent.append(h)
            self.stats["stores interrupted"] += bool(caught)
        elif op == "load":
            pool = self.recent[-4:] if self.recent and rng.random() < 0.8 else self.prompts
            h = pool[int(rng.integers(len(pool)))]
            with interruptible():
                n = off.lookup(h)
                self.stats["lookup hits" if n else "lookup misses"] += 1
                free = sorted(set(range(NB)) - self.busy)
                if n and len(free) >= n:
                    dst = [int(b) for b in rng.choice(free, n, replace=False)]
                    job = self.reports.issue(off.load(h[:n], dst))
                    self.stats["loads"] += 1
                    if job is not None:
                        self.loads[job] = (dst, h[:n])
                        self.busy |= set(dst)
        elif op == "poll":
            with interruptible():
                self.handle(off.poll())
        elif op in ("wait", "bad_wait"):
            open_ids = [j for j in self.reports.issued if self.reports.seen[j] == 0]
            pick = [j for j in open_ids if rng.random() < 0.5]
            if op == "bad_wait":
                with self.injector.paused(), pytest.raises(KVOffloadError):
                    off.wait([*pick, 10**9])
                self.stats["bad waits refused"] += 1
                return
            with interruptible():
                self.handle(off.wait(pick if rng.random() < 0.7 else None))
        elif op == "reset":
            with interruptible():
                off.reset_cache()
        elif op == "close":
            self.close()
            self.stats["lives"] += 1
            self.open()
        elif op == "interrupt":
            self.injector.arm(int(rng.integers(1, 12)), str(rng.choice(["raise", "signal"])))
        elif op == "fault":
            self.faults.arm(ERRORS[int(rng.integers(len(ERRORS)))])
        elif op == "slow":  # keeps the next worker copies in flight across later steps
            self.faults.slow_down(float(rng.uniform(0.002, 0.02)), int(rng.integers(1, 4)))

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step(str(self.rng.choice(OPS, p=WEIGHTS / WEIGHTS.sum())))
            if self.injector.fired:
                self.stats["interrupts"] += 1
                self.injector.disarm()
                self.injector.fired = None
        self.injector.disarm()
        self.faults.arm(None, 0)
        self.faults.slow_down(0.0, 0)
        self.handle(self.off.wait())
        assert pins(self.off) == (0, 0)
        self.close()


@pytest.mark.slow  # a soak
@pytest.mark.parametrize("seed", SEEDS)
def test_soak(monkeypatch, seed):
    started = time.perf_counter()
    soak = Soak(seed, monkeypatch)
    soak.run(STEPS)
    stats = dict(sorted(soak.stats.items()))
    print(f"soak seed={seed} steps={STEPS} {time.perf_counter() - started:.1f}s {stats}")
    assert soak.corrupted_bytes == 0, f"seed {seed}: {soak.corrupted_bytes} corrupted bytes"
    assert soak.stats["blocks verified"] > 0
