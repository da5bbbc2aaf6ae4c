"""The secondary-tier path of `KVOffloader` under faults: every job still reported
exactly once, no pin left behind, never a wrong byte, whatever a tier does.

Tiny host store (6 chunks of 2 blocks), block contents a function of their hash, and a
`FakeTier` that misses, fails, stalls or drops on demand."""

from __future__ import annotations

import signal
import threading

import numpy as np
import pytest

from jax_kvoffload.hostmem import HostChunkPool
from jax_kvoffload.store import HostStore, LookupResult, make_offload_key

from ._helpers import (
    CALLER_TARGETS,
    Gate,
    Injector,
    Reports,
    blocks,
    config,
    expected,
    hashes,
    interruptible,
    offloader,
    pins,
    write_blocks,
)
from ._tiers import FakeTier


def stored(tier=None, n_blocks=8, prompt="p", chunks=6):
    """An offloader over `tier` whose host and tier hold the chunks of `prompt`."""
    tier = tier or FakeTier()
    off = offloader(config(chunks=chunks), tiers=[tier])
    hs = hashes(prompt, n_blocks)
    ids = list(range(n_blocks))
    write_blocks(off, ids, hs)
    job = off.store(hs, ids)
    assert off.wait([job])[0].success
    assert off.flush_tiers(timeout=30)
    return off, tier, hs


def fresh(tier):
    """A second offloader (another engine) over the same tier: its host is empty."""
    return offloader(config(), seed=7, tiers=[tier])


def load_into(off, hs, targets, reports=None):
    job = off.load(hs, targets)
    if reports is not None:
        reports.issue(job)
    (result,) = off.wait([job])
    if reports is not None:
        reports.record([result])
    return result


def test_cascade_then_promotion_serves_another_engine_byte_for_byte():
    off, tier, hs = stored()
    assert len(tier.entries) == 4  # 8 blocks = 4 chunks, each in the tier
    s = off.tier_stats[0]
    assert (s.cascaded, s.cascade_dropped, s.cascade_path) == (4, 0, "host->remote")
    assert pins(off) == (0, 0)  # the cascade's pins are gone
    off.close()
    other = fresh(tier)
    assert other.lookup(hs) == 8  # promoted into the host: loadable now
    targets = [20, 21, 22, 23, 24, 25, 26, 27]
    assert load_into(other, hs, targets).success
    np.testing.assert_array_equal(blocks(other, targets), expected(hs))
    assert other.tier_stats[0].promoted == 4 and pins(other) == (0, 0)
    other.close()


def test_an_asynchronous_lookup_counts_the_host_now_and_the_promotions_later():
    off, tier, hs = stored()
    off.close()
    other = fresh(tier)
    tier.load_gate = threading.Event()
    assert other.lookup(hs, wait=False) == 0  # promotions in flight (vLLM's RETRY)
    assert other.lookup(hs, wait=False) == 0  # asked again: no second promotion
    assert other.tier_stats[0].promotion_jobs == 1
    tier.load_gate.set()
    assert other.flush_tiers(timeout=30)
    assert other.lookup(hs, wait=False) == 8
    assert load_into(other, hs, list(range(20, 28))).success
    np.testing.assert_array_equal(blocks(other, list(range(20, 28))), expected(hs))
    other.close()


def test_a_load_without_lookup_promotes_then_loads():
    off, tier, hs = stored()
    off.close()
    other = fresh(tier)
    reports = Reports()
    assert load_into(other, hs[:4], [9, 10, 11, 12], reports).success
    np.testing.assert_array_equal(blocks(other, [9, 10, 11, 12]), expected(hs[:4]))
    reports.check_exactly_once()
    assert pins(other) == (0, 0)
    other.close()


def test_chunks_evicted_from_the_host_come_back_from_the_tier():
    off, _tier, first = stored(n_blocks=8)  # 4 chunks of the 6
    second = hashes("q", 8)
    write_blocks(off, list(range(8, 16)), second)
    assert off.wait([off.store(second, list(range(8, 16)))])[0].success  # evicts 2 of `first`
    assert off.flush_tiers(timeout=30)
    misses = [off._store.lookup(make_offload_key(h, 0)) for h in first[1::2]]
    assert LookupResult.MISS in misses
    assert off.lookup(first) == 8
    assert load_into(off, first, list(range(16, 24))).success
    np.testing.assert_array_equal(blocks(off, list(range(16, 24))), expected(first))
    off.close()


def test_a_promotion_that_misses_shortens_the_lookup_and_the_load_fails_cleanly():
    off, tier, hs = stored()
    off.close()
    tier.lost.add(make_offload_key(hs[5], 0))  # chunk 2: present, then gone when read
    other = fresh(tier)
    assert other.lookup(hs) == 4  # what it reports loadable must load
    assert load_into(other, hs[:4], [9, 10, 11, 12]).success
    np.testing.assert_array_equal(blocks(other, [9, 10, 11, 12]), expected(hs[:4]))
    assert other.tier_stats[0].promotion_failed == 1
    # A load given the missing chunk directly: promoted, misses, fails (recompute).
    targets = [13, 14, 15, 16, 17, 18, 19, 20]
    others = [b for b in range(32) if b not in targets]
    before = blocks(other, others)
    reports = Reports()
    result = load_into(other, hs, targets, reports)
    reports.check_exactly_once()
    assert not result.success and "missed in secondary tier" in result.error
    np.testing.assert_array_equal(blocks(other, others), before)  # nothing else written
    assert pins(other) == (0, 0)
    assert other._store.lookup(make_offload_key(hs[5], 0)) is LookupResult.MISS  # freed
    other.close()


def test_a_tier_failing_mid_promotion_fails_the_load_once_and_frees_the_chunks():
    off, tier, hs = stored()
    off.close()
    other = fresh(tier)
    tier.load_gate = threading.Event()
    tier.load_raises = OSError("disk on fire")
    reports = Reports()
    job = reports.issue(other.load(hs, list(range(20, 28))))
    assert tier.loads_started.wait(10)
    assert reports.record(other.poll()) == []  # in flight: nothing yet
    tier.load_gate.set()
    (result,) = reports.record(other.wait([job]))
    assert not result.success
    reports.check_exactly_once()
    assert pins(other) == (0, 0)
    assert other._store.num_free_chunks == other.num_chunks  # every promoted chunk freed
    tier.load_raises = None
    assert other.lookup(hs) == 8  # the tier works again
    other.close()


def test_close_during_a_cascade_waits_for_it_and_reports_once():
    tier = FakeTier()
    tier.store_gate = threading.Event()
    off = offloader(config(), tiers=[tier])
    hs = hashes("c", 4)
    write_blocks(off, [0, 1, 2, 3], hs)
    reports = Reports()
    reports.issue(off.store(hs, [0, 1, 2, 3]))
    reports.record(off.wait())  # settles the store: the cascade starts, and stalls
    assert tier.stores_started.wait(10)
    threading.Timer(0.3, tier.store_gate.set).start()
    reports.record(off.close())  # waits for the cascade
    reports.check_exactly_once()
    assert len(tier.entries) == 2 and off.tier_stats[0].cascaded == 2
    assert not tier._closed  # a tier the caller passed is the caller's to close
    other = fresh(tier)
    assert other.lookup(hs) == 4
    other.close()
    tier.close()


def test_reset_during_a_cascade_and_a_promotion_waits_for_both():
    off, tier, hs = stored()
    off.close()
    other = fresh(tier)
    tier.load_gate = threading.Event()
    assert other.lookup(hs, wait=False) == 0
    threading.Timer(0.3, tier.load_gate.set).start()
    other.reset_cache()  # drains the promotion before forgetting the chunks
    assert other.tier_stats[0].promoted == 4
    assert other._store.num_free_chunks == other.num_chunks
    assert other.lookup(hs) == 8  # promotes again, into the new generation
    assert load_into(other, hs, list(range(20, 28))).success
    np.testing.assert_array_equal(blocks(other, list(range(20, 28))), expected(hs))
    other.close()


def test_promotions_wait_for_transfer_jobs_older_than_a_reset(monkeypatch):
    off, tier, hs = stored()
    off.close()
    other = fresh(tier)
    mine = hashes("m", 2)
    write_blocks(other, [0, 1], mine)
    gate = Gate(monkeypatch, HostChunkPool, "write_blocks")
    job = other.store(mine, [0, 1])  # its host copy stalls: in flight across the reset
    assert gate.entered.wait(10)
    other.reset_cache()
    # The old job still writes a row the reset freed: no promotion may fill one now.
    assert other.lookup(hs) == 0
    assert other.tier_stats[0].promotion_jobs == 0
    gate.open()
    other.wait([job])
    assert other.lookup(hs) == 8  # released once the old job has ended
    assert load_into(other, hs, list(range(20, 28))).success
    np.testing.assert_array_equal(blocks(other, list(range(20, 28))), expected(hs))
    other.close()


def test_dropped_cascades_are_counted_and_never_stall_the_engine():
    tier = FakeTier()
    tier.drop_stores = True
    off, _, hs = stored(tier)
    s = off.tier_stats[0]
    assert (s.cascaded, s.cascade_dropped) == (0, 4)
    assert pins(off) == (0, 0) and not tier.entries
    assert off.lookup(hs) == 8  # the host still has them
    off.close()


def test_an_interrupted_lookup_wait_loses_nothing():
    off, tier, hs = stored()
    off.close()
    other = fresh(tier)
    tier.load_gate = threading.Event()
    timer = threading.Timer(0.2, signal.raise_signal, (signal.SIGINT,))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        other.lookup(hs)  # waiting for the promotion when the SIGINT arrives
    tier.load_gate.set()
    assert other.lookup(hs) == 8  # the same promotion, recorded now
    assert other.tier_stats[0].promotion_jobs == 1
    assert load_into(other, hs, list(range(20, 28))).success
    assert pins(other) == (0, 0)
    other.close()


# -- interrupts at every caller-side step of the tier path ------------------------------

TIER_TARGETS = [
    *CALLER_TARGETS,
    (FakeTier, "contains"),
    (FakeTier, "submit_store"),
    (FakeTier, "submit_load"),
]


def tier_scenario(off, reports, loads, a, b):
    """lookup A (from the tier), load it, store B (a cascade), reset, again; each step
    swallowing an interrupt."""
    hit = 0

    def step(fn):
        nonlocal hit
        with interruptible() as caught:
            return fn()
        hit += bool(caught)
        return None

    def load(hs, dst):
        n = step(lambda: off.lookup(hs)) or 0
        job = reports.issue(step(lambda: off.load(hs[:n], dst[:n])) if n else None)
        if job is not None:
            loads[job] = (dst[:n], hs[:n])

    load(a, [10, 11, 12, 13])
    reports.issue(step(lambda: off.store(b, [5, 6, 7, 8])))
    reports.record(step(off.wait) or [])
    step(off.reset_cache)
    load(a, [20, 21, 22, 23])
    reports.record(step(off.close) or [])
    return hit


def tier_run(monkeypatch, tier, a, at, mode):
    off = fresh(tier)
    b = hashes("b", 4)
    write_blocks(off, [5, 6, 7, 8], b)
    injector = Injector(monkeypatch, TIER_TARGETS)
    injector.arm(at, mode)
    reports, loads = Reports(), {}
    hit = tier_scenario(off, reports, loads, a, b)
    injector.disarm()
    context = f"interrupt {injector.fired}"
    assert hit == (injector.fired is not None), context
    reports.record(off.close())
    reports.check_exactly_once(context)
    assert pins(off) == (0, 0), context
    assert off._tiers.in_flight == 0 and tier.drain(10), context
    for job, (dst, hs) in loads.items():
        if reports.results[job].success:
            np.testing.assert_array_equal(blocks(off, dst), expected(hs), err_msg=context)
    monkeypatch.undo()
    return injector


@pytest.mark.parametrize("mode", ["raise", "signal"])
def test_an_interrupt_at_any_step_of_the_tier_path_leaves_consistent_state(monkeypatch, mode):
    first, tier, a = stored(n_blocks=4, prompt="a")
    first.close()
    total = tier_run(monkeypatch, tier, a, 10**9, "raise").calls
    assert total >= 15, total
    names = set()
    for at in range(1, total + 2):
        injector = tier_run(monkeypatch, tier, a, at, mode)
        if injector.fired:
            names.add(injector.fired.split(" at ")[1].split(" (")[0])
    for name in ("FakeTier.contains", "FakeTier.submit_load", "FakeTier.submit_store",
                 "HostStore.prepare_store", "HostStore.complete_store"):  # fmt: skip
        assert name in names, (name, sorted(names))
    tier.close()


def test_a_promotion_recorded_halfway_is_finished_once(monkeypatch):
    off, tier, hs = stored()
    off.close()
    tier.lost.add(make_offload_key(hs[7], 0))  # chunk 3 misses: the job frees it, stores 0-2
    other = fresh(tier)
    injector = Injector(monkeypatch, [(HostStore, "complete_store")])
    injector.arm(2, "raise")  # the second store call of the job's record: the good keys
    with pytest.raises(KeyboardInterrupt):
        other.lookup(hs)
    injector.disarm()
    assert injector.fired and "complete_store" in injector.fired
    assert other.lookup(hs) == 6  # recorded now: chunk 3 freed once, 0-2 readable
    assert load_into(other, hs[:6], list(range(20, 26))).success
    np.testing.assert_array_equal(blocks(other, list(range(20, 26))), expected(hs[:6]))
    assert pins(other) == (0, 0)
    other.close()
