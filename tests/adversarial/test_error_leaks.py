"""No error a `KVOffloader` call raises leaks its internals: the methods of its parts
(the host store's `prepare_load`, the engine's `set_arrays`, ...), private names, or
the raw bytes of a key. A caller gave block hashes by position: errors say which (by
index) and what to call first.

A class check, not one case: random call sequences (never-stored prefixes, stores not
yet collected, evictions, resets, bad arguments, with and without a secondary tier)
collect every message, each checked against the names of every part's methods.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from jax_kvoffload import KVOffloader
from jax_kvoffload.errors import KVOffloadError
from jax_kvoffload.offloader._cascade import TierPath
from jax_kvoffload.offloader._job_book import JobBook
from jax_kvoffload.store import HostStore, KeyNotReadyError, KeyNotStoredError
from jax_kvoffload.tiers import SecondaryTier
from jax_kvoffload.transfer import TransferEngine
from tests.faults._helpers import NB, config, hashes, noise, offloader, write_blocks
from tests.faults._tiers import FakeTier


def _public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


PARTS = set().union(*map(_public, (HostStore, TransferEngine, TierPath, JobBook, SecondaryTier)))
INTERNAL = sorted(PARTS - _public(KVOffloader))
# Code names (`prepare_load`) anywhere; the parts' plain-word methods (`touch`,
# `promote`) as calls only, since the words are English too.
LEAKS = re.compile(
    "|".join(rf"\b{n}\b" if "_" in n else rf"\b{n}\(" for n in INTERNAL)
    + r"|\b_[a-z]\w*|\bb'|\bb\"|\\x[0-9a-f]{2}"
)


def leaks(message: str, used: list[bytes]) -> list[str]:
    found = [m.group(0) for m in LEAKS.finditer(message)]
    found += [h.hex()[:12] for h in used if h.hex()[:12] in message]
    return found


def test_a_prefix_never_stored_names_the_callers_hash_by_index_and_the_fix():
    off = offloader()
    with off:
        h = hashes("a", 6)
        write_blocks(off, [1, 2, 3, 4], h[:4])
        assert off.wait([off.store(h[:4], [1, 2, 3, 4])])[0].success
        with pytest.raises(KeyNotStoredError) as e:
            off.load(h, [10, 11, 12, 13, 14, 15])  # chunks 0, 1 stored; chunk 2 never
        message = str(e.value)
        assert "block_hashes[5]" in message and "lookup(block_hashes)" in message
        assert not leaks(message, h), message
        job = off.store(hashes("b", 2), [5, 6])
        with pytest.raises(KeyNotReadyError, match=r"block_hashes\[1\] .*poll\(\) or wait\(\)"):
            off.load(hashes("b", 2), [7, 8])  # its store is not collected yet
        off.wait([job])


def _calls(off: KVOffloader, rng: np.random.Generator, used: list[bytes]):
    prefix = f"p{int(rng.integers(0, 6))}"
    n = int(rng.integers(0, 9))
    h = hashes(prefix, n)
    used.extend(h)
    ids = [int(i) for i in rng.permutation(NB)[:n]]
    return [
        lambda: off.store(h, ids),
        lambda: off.load(h, ids),
        lambda: off.load(hashes(f"never{int(rng.integers(0, 10**6))}", n), ids),
        lambda: off.lookup(h),
        lambda: off.wait(),
        lambda: off.poll(),
        lambda: off.wait([int(rng.integers(0, 50))]),
        lambda: off.reset_cache(),
        lambda: off.store(h, ids[:-1] if ids else [1]),
        lambda: off.load(h, [NB + 1] * n),
        lambda: off.lookup([*h, "x"]),
        lambda: off.set_caches(noise()[:1]),
        lambda: off.store(h, ids, group=3),
    ]


@pytest.mark.parametrize("tiered", [False, True])
def test_no_error_of_a_random_call_sequence_leaks_internals(tiered):
    seed = 2100 + tiered
    rng = np.random.default_rng(seed)
    print(f"seed={seed}")
    tier = FakeTier() if tiered else None
    off = offloader(config(chunks=3), tiers=None if tier is None else [tier])
    used: list[bytes] = []
    messages: list[str] = []
    missed = 0
    with off:
        for _ in range(160):
            calls = _calls(off, rng, used)
            try:
                calls[int(rng.integers(0, len(calls)))]()
            except KVOffloadError as e:
                messages.append(f"{type(e).__name__}: {e}")
                missed += isinstance(e, KeyNotStoredError)
        off.wait()
    if tier is not None:
        tier.close()
    assert len(messages) > 40  # the sequence did reach the refusals
    assert missed > 5  # loads of prefixes never stored among them
    bad = [(m, leaks(m, used)) for m in messages if leaks(m, used)]
    assert not bad, bad[:5]
