"""Every registered tier kind keeps `SecondaryTier`'s contract: round trip, damaged
entries are counted misses, namespaces never mix, a slow tier drops stores and says so,
close is bounded and leaves nothing behind, concurrent callers, restart reuse.

Each kind runs through its harness (`_contract_harnesses.py`); the Redis one starts a
private `redis-server` on a free loopback port for the module and stops it at the end.
"""

from __future__ import annotations

import pytest

from jax_kvoffload.tiers import tier_kinds

from . import _contract
from ._contract import CHECKS, HARNESSES
from ._contract_harnesses import DiskHarness

KINDS = [k.name for k in tier_kinds()]


def test_every_registered_kind_has_a_harness():
    assert KINDS and set(KINDS) <= set(HARNESSES), sorted(set(KINDS) - set(HARNESSES))


@pytest.fixture(scope="module", params=KINDS)
def harness(request, tmp_path_factory):
    if request.param not in HARNESSES:
        pytest.fail(f"tier kind {request.param!r} has no contract harness")
    h = HARNESSES[request.param]()
    h.start(str(tmp_path_factory.mktemp(f"contract-{request.param}")))
    yield h
    h.stop()


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_contract(harness, check):
    check(harness)


def test_the_suite_sees_a_tier_that_returns_damaged_bytes(tmp_path, monkeypatch):
    """The suite can fail: a disk tier whose reads skip the payload's CRC32C serves the
    damaged entry, and the damage check says so."""
    from jax_kvoffload.tiers import _disk, _disk_entry

    for module in (_disk, _disk_entry):  # written and checked as 0: no check at all
        monkeypatch.setattr(module, "crc32c", lambda data, value=0: 0)
    harness = DiskHarness()
    harness.start(str(tmp_path))
    with pytest.raises(AssertionError):
        _contract.check_a_damaged_entry_is_a_miss_and_counted(harness)
