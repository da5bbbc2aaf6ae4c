"""A secondary tier that answers its jobs wrongly cannot make the offloader raise, nor
a key read as stored or loaded when it is not.

`SecondaryTier` is pluggable: a third-party tier builds its own `TierJobResult`s. Before:
flags of any type were taken (`("no",)` read as success: a non-empty string is
truthy), fewer flags than keys failed later in the offloader's `zip(strict=True)` with
a bare `ValueError` raised from `poll()`/`lookup()`, and a future resolving to
anything but a result raised `AttributeError` there. Now a result is checked when it is
built, and a job whose future holds no result is counted failed (its keys are misses).
"""

from __future__ import annotations

import numpy as np
import pytest

from jax_kvoffload.errors import KVOffloadError
from jax_kvoffload.tiers import TierJobResult
from tests.faults._helpers import blocks, config, expected, hashes, offloader, write_blocks
from tests.faults._tiers import FakeTier

BAD_RESULTS = [
    dict(kind="store", keys=(b"k1",), ok=("no",)),
    dict(kind="store", keys=(b"k1", b"k2"), ok=(True,)),
    dict(kind="load", keys=(b"k1",), ok=True),
    dict(kind="load", keys=(b"k1",), ok=(1,)),
    dict(kind="delete", keys=(b"k1",), ok=(True,)),
    dict(kind="store", keys=b"k1", ok=(True,)),
    dict(kind="store", keys=(b"k1",), ok=None),
]


@pytest.mark.parametrize("fields", BAD_RESULTS, ids=lambda f: repr(f)[:50])
def test_a_result_that_cannot_say_what_happened_is_refused(fields):
    with pytest.raises(KVOffloadError):
        TierJobResult(**fields)


def test_flags_of_numpy_bools_are_kept_as_bools():
    r = TierJobResult("load", [b"a", b"b"], np.array([True, False]))
    assert r.keys == (b"a", b"b") and r.ok == (True, False) and r.ok_keys == (b"a",)
    assert all(type(f) is bool for f in r.ok)


class NoResultTier(FakeTier):
    """Stores and loads run (bytes move) but their futures resolve to `answer`."""

    def __init__(self, answer):
        super().__init__()
        self.answer = answer

    def _store(self, data):
        super()._store(data)
        return self.answer

    def _load(self, data):
        super()._load(data)
        return self.answer


@pytest.mark.parametrize("answer", [None, "ok", (True, True)])
def test_a_tier_whose_jobs_return_no_result_fails_its_keys_and_nothing_raises(answer):
    tier = NoResultTier(answer)
    off = offloader(config(chunks=6), tiers=[tier])
    hs = hashes("p", 8)
    write_blocks(off, list(range(8)), hs)
    assert off.wait([off.store(hs, list(range(8)))])[0].success
    assert off.flush_tiers(timeout=30)
    off.poll()
    s = off.tier_stats[0]
    assert s.cascaded == 0 and s.cascade_failed == 4  # no result: not stored
    assert off.lookup(hs) == 8  # the host still has them
    assert off.wait([off.load(hs, list(range(8, 16)))])[0].success
    np.testing.assert_array_equal(blocks(off, list(range(8, 16))), expected(hs))
    off.close()
    other = offloader(config(), seed=7, tiers=[tier])  # another engine: host empty
    with other:
        n = other.lookup(hs)  # promotions answer nothing: nothing counts
        assert n == 0
        other.poll()
    tier.close()
