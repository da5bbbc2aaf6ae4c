"""`KVOffloader`'s tier path from the public API, used the way a careless or hostile
caller would: repeated block hashes in one call, timeouts that are not numbers, a
`wait=` that is not a bool, tiers that are not quite tiers.

Each case ends with the checks that matter: every job reported once, the bytes a
successful load delivers are the bytes stored under its keys, no chunk left pinned or
write-pending, and no call that waits without bound."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from jax_kvoffload.errors import KVOffloadTypeError, KVOffloadValueError
from tests.faults._helpers import (
    Reports,
    blocks,
    config,
    expected,
    hashes,
    offloader,
    pins,
    write_blocks,
)
from tests.faults._tiers import FakeTier


def stored_in(tier: FakeTier, prompt: str = "a", n: int = 4) -> list[bytes]:
    """A first engine stores `prompt`'s chunks, which cascade into `tier`."""
    off = offloader(config(), tiers=[tier])
    hs = hashes(prompt, n)
    write_blocks(off, list(range(n)), hs)
    assert off.wait([off.store(hs, list(range(n)))])[0].success
    assert off.flush_tiers(timeout=30)
    off.close()
    return hs


# -- one hash twice in one call -----------------------------------------------------------


@pytest.mark.parametrize("with_tier", [False, True])
def test_a_store_naming_a_chunk_twice_leaves_no_chunk_write_pending(with_tier):
    # The chunk key [h1, h1] (blocks [h0, h1, h0, h1]) used to get two host chunks; the
    # second stayed write-pending forever (never evictable: the host store shrank by
    # one chunk per such call until every offer was dropped).
    tier = FakeTier()
    off = offloader(config(), tiers=[tier] if with_tier else None)
    h = hashes("x", 2)
    twice = [h[0], h[1], h[0], h[1]]
    write_blocks(off, [0, 1, 2, 3], twice)
    (result,) = off.wait([off.store(twice, [0, 1, 2, 3])])
    assert result.success and off.flush_tiers(timeout=30)
    assert pins(off) == (0, 0), "a chunk is left pinned or write-pending"
    assert off._store.num_occupied_chunks == 1  # one key, one chunk
    assert off.lookup(h) == 2
    assert off.wait([off.load(h, [10, 11])])[0].success
    np.testing.assert_array_equal(blocks(off, [10, 11]), expected(h))
    off.close()
    tier.close()


def test_a_lookup_and_a_load_naming_a_tier_chunk_twice_promote_it_once():
    # Used to raise KeyError out of lookup() and leave two chunks write-pending.
    tier = FakeTier()
    hs = stored_in(tier)
    twice = [hs[0], hs[1], hs[0], hs[1]]
    off = offloader(config(), seed=3, tiers=[tier])
    assert off.lookup(twice) == 4
    assert off.tier_stats[0].promoted == 1 and pins(off) == (0, 0)
    reports = Reports()
    job = reports.issue(off.load(twice, [10, 11, 12, 13]))
    (result,) = reports.record(off.wait([job]))
    reports.check_exactly_once()
    assert result.success
    np.testing.assert_array_equal(blocks(off, [10, 11, 12, 13]), expected(twice))
    assert pins(off) == (0, 0)
    off.close()
    # A load given the repeated tier chunk directly (no lookup): one promotion, one pin.
    other = offloader(config(), seed=4, tiers=[tier])
    (result,) = other.wait([other.load(twice, [20, 21, 22, 23])])
    assert result.success and pins(other) == (0, 0)
    np.testing.assert_array_equal(blocks(other, [20, 21, 22, 23]), expected(twice))
    assert other.tier_stats[0].promotion_jobs == 1
    other.close()
    tier.close()


# -- arguments that are not what they say --------------------------------------------------


@pytest.mark.parametrize(
    "timeout, family",
    [
        (float("nan"), KVOffloadValueError),  # used to wait without bound
        ("1", KVOffloadTypeError),
        (True, KVOffloadTypeError),
        ([1], KVOffloadTypeError),
    ],
)
def test_flush_tiers_refuses_a_timeout_that_is_not_a_number(timeout, family):
    tier = FakeTier()
    tier.store_gate = threading.Event()  # a cascade stays in flight
    off = offloader(config(), tiers=[tier])
    hs = hashes("t", 4)
    write_blocks(off, [0, 1, 2, 3], hs)
    off.wait([off.store(hs, [0, 1, 2, 3])])
    done = {}

    def flush():
        try:
            done["value"] = off.flush_tiers(timeout=timeout)
        except Exception as e:
            done["value"] = e

    caller = threading.Thread(target=flush, daemon=True)
    caller.start()
    caller.join(5)
    hung = caller.is_alive()
    tier.store_gate.set()
    caller.join(10)
    assert not hung, f"flush_tiers(timeout={timeout!r}) waited without bound"
    assert isinstance(done["value"], family), done["value"]
    assert off.flush_tiers(timeout=-1) in (True, False)  # a past deadline: at once
    assert off.flush_tiers(timeout=float("inf"))  # no bound, as None
    off.close()
    tier.close()


@pytest.mark.parametrize("wait", ["no", None, 0, 1.0, [True]])
def test_lookup_wait_must_be_a_bool(wait):
    # "no" used to wait (truthy), None not to: an argument error names it instead.
    tier = FakeTier()
    off = offloader(config(), tiers=[tier])
    with pytest.raises(KVOffloadTypeError, match="wait"):
        off.lookup(hashes("w", 4), wait=wait)
    assert off.lookup(hashes("w", 4), wait=False) == 0
    off.close()
    tier.close()


class NoMedium(FakeTier):
    medium = ""  # SecondaryTier's default: a subclass that forgot to say


class NotATier:
    medium = "remote"


def test_a_tier_without_a_known_medium_is_refused_when_the_offloader_is_built():
    # Used to be accepted, then stats() / tier_stats raised ValueError from any thread
    # (a metrics exporter), after the tier had already taken cascades.
    tier = NoMedium()
    with pytest.raises(KVOffloadValueError, match="medium"):
        offloader(config(), tiers=[tier])
    tier.close()
    with pytest.raises(KVOffloadTypeError, match="SecondaryTier"):
        offloader(config(), tiers=[NotATier()])


def test_tiers_given_as_an_iterator_are_used():
    # A generator used to be consumed by the type check, leaving no tier at all.
    tier = FakeTier()
    off = offloader(config(), tiers=(t for t in [tier]))
    assert off.secondary_tiers == (tier,)
    off.close()
    tier.close()


# -- finished cascades release their pins before a store needs room -----------------------


def test_a_store_loop_keeps_storing_once_the_host_is_full_of_cascaded_chunks():
    # The cascades' pins were released only by poll / lookup / load / flush_tiers: an
    # engine that only stores and waits (a writer) had every offer dropped once the host
    # was full, though each cascade had long finished (vLLM's prepare_store polls the
    # tiers first for this reason).
    tier = FakeTier()
    off = offloader(config(chunks=2), tiers=[tier])
    for i in range(4):
        h = hashes(f"loop{i}", 4)  # 2 chunks: the whole host each time
        write_blocks(off, [0, 1, 2, 3], h)
        job = off.store(h, [0, 1, 2, 3])
        assert job is not None, f"store {i} was dropped: the host is pinned by {pins(off)}"
        assert off.wait([job])[0].success
        assert tier.drain(10)  # the cascade has finished (not yet seen by the offloader)
    assert len(tier.entries) == 8
    off.close()
    tier.close()


@pytest.mark.parametrize("error", [RuntimeError("a policy failed"), KeyboardInterrupt()])
def test_a_load_whose_promotion_raises_leaves_no_pin(monkeypatch, error):
    # The chunks already in the host were pinned before the tier chunks' promotion was
    # prepared; an error there (the host store's eviction policy, an interrupt injected
    # at the store call) left them pinned for good.
    from jax_kvoffload.store import HostStore

    tier = FakeTier()
    hs = stored_in(tier)
    off = offloader(config(), seed=3, tiers=[tier])
    assert off.lookup(hs[:2]) == 2  # chunk 0 in the host, chunk 1 only in the tier
    real = HostStore.prepare_store

    def failing(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(HostStore, "prepare_store", failing)
    with pytest.raises(type(error)):
        off.load(hs, [10, 11, 12, 13])
    monkeypatch.setattr(HostStore, "prepare_store", real)
    assert pins(off) == (0, 0)
    (result,) = off.wait([off.load(hs, [10, 11, 12, 13])])  # works afterwards
    assert result.success and pins(off) == (0, 0)
    np.testing.assert_array_equal(blocks(off, [10, 11, 12, 13]), expected(hs))
    off.close()
    tier.close()


@pytest.mark.parametrize("host_pool", ["np.zeros(2)", "HostChunkPool", "['pinned']"])
def test_host_pool_is_a_pool_name_and_says_so(host_pool):
    # An array used to fail with numpy's "truth value of an array is ambiguous".
    from jax_kvoffload.hostmem import HostChunkPool

    value = {"np.zeros(2)": np.zeros(2), "HostChunkPool": HostChunkPool(2, {0: 8}, 2),
             "['pinned']": ["pinned"]}[host_pool]  # fmt: skip
    with pytest.raises(KVOffloadTypeError, match=r"host_pool.*pool name"):
        offloader(config(), host_pool=value)


class Raising(FakeTier):
    """A tier raising in every method the tier path calls."""

    def contains(self, keys):
        raise RuntimeError("contains")

    def submit_store(self, items):
        raise RuntimeError("submit_store")

    def submit_load(self, items):
        raise RuntimeError("submit_load")


def test_a_tier_raising_everywhere_costs_misses_and_counts_never_a_call():
    tier = Raising()
    off = offloader(config(), tiers=[tier])
    hs = hashes("r", 4)
    write_blocks(off, [0, 1, 2, 3], hs)
    reports = Reports()
    job = reports.issue(off.store(hs, [0, 1, 2, 3]))
    assert reports.record(off.wait([job]))[0].success  # the cascade failed, not the store
    assert off.tier_stats[0].cascade_failed == 2 and pins(off) == (0, 0)
    assert off.lookup(hashes("other", 4)) == 0  # the tier's lookup failed: misses
    assert off.lookup(hs) == 4  # the host still serves
    assert off.flush_tiers(timeout=5)
    off.reset_cache()
    assert off.stats().tiers[0].failed == 2
    reports.record(off.close())
    reports.check_exactly_once()
    tier.close()


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_a_file_where_the_tier_directory_goes_is_not_called_a_link(tmp_path, kind):
    # Before: "is not a directory; links are never followed: configure the real
    # directory (<the same path>) instead" for a plain file: advice that fixes nothing.
    from jax_kvoffload.tiers import DiskTier, UnsafeDirectoryError

    path = tmp_path / "tier"
    path.write_bytes(b"") if kind == "file" else os.mkfifo(path)
    with pytest.raises(UnsafeDirectoryError, match="not a directory: point path") as e:
        DiskTier.check_path(str(path))
    assert "link" not in str(e.value)
