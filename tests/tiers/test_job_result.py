"""`TierJobResult` never reads as success when it is not.

Before: `ok` was a plain tuple of per-key flags, so `assert result.ok` (as docs/tiers.md
wrote it) and `if result.ok:` passed for a job whose every key failed: a non-empty
tuple is truthy. Now neither the result nor `ok` has a truth value; `all_ok`,
`ok_keys` and `failed_keys` say what happened.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from jax_kvoffload.errors import KVOffloadError, KVOffloadTypeError
from jax_kvoffload.tiers import DiskTier, DiskTierConfig, TierJobResult

from ._helpers import key, payload

NS = bytes(range(32))

RESULTS = {
    "every key failed": TierJobResult("store", (b"k1", b"k2"), (False, False)),
    "one of two failed": TierJobResult("load", (b"k1", b"k2"), (True, False)),
    "every key ok": TierJobResult("store", (b"k1",), (True,)),
    "dropped": TierJobResult("store", (b"k1",), (False,), dropped=True),
    "no keys": TierJobResult("load", (), ()),
}


@pytest.mark.parametrize("name", sorted(RESULTS))
def test_neither_a_result_nor_its_flags_has_a_truth_value(name):
    r = RESULTS[name]
    for value in (r, r.ok):
        with pytest.raises(KVOffloadTypeError, match="all_ok") as err:
            bool(value)
        assert isinstance(err.value, (TypeError, KVOffloadError))
        with pytest.raises(TypeError):
            assert value  # the docs' old `assert ....result().ok` no longer passes silently
        with pytest.raises(TypeError):
            _ = "yes" if value else "no"


def test_the_unambiguous_readings():
    r = RESULTS["one of two failed"]
    assert (r.all_ok, r.ok_keys, r.failed_keys) == (False, (b"k1",), (b"k2",))
    assert r.ok == (True, False) and list(r.ok) == [True, False] and r.ok[1] is False
    assert any(r.ok) and not all(r.ok)
    assert RESULTS["every key ok"].all_ok and not RESULTS["every key failed"].all_ok
    assert not RESULTS["dropped"].all_ok and RESULTS["no keys"].all_ok
    # Still a value: equal to one built again, hashable, picklable (results cross
    # processes in the two-process demo and vLLM's workers).
    again = TierJobResult("load", (b"k1", b"k2"), [True, False])
    assert again == r and hash(again) == hash(r) and again.ok == (True, False)
    assert pickle.loads(pickle.dumps(r)) == r


def test_a_tier_job_whose_every_key_failed_reads_as_failed(tmp_path):
    # A budget smaller than one entry: every store fails (nothing is dropped).
    tier = DiskTier(DiskTierConfig(path=str(tmp_path / "t"), capacity_bytes=4096), NS)
    try:
        items = [(key(i), payload(key(i), 8192)) for i in (1, 2)]
        r = tier.submit_store(items).result(timeout=30)
        assert r.ok == (False, False) and not r.dropped
        assert not r.all_ok and r.failed_keys == (key(1), key(2)) and r.ok_keys == ()
        with pytest.raises(KVOffloadTypeError):
            assert r.ok
        out = np.zeros(8192, np.uint8)
        loaded = tier.submit_load([(key(1), out)]).result(timeout=30)
        assert not loaded.all_ok and loaded.failed_keys == (key(1),)
    finally:
        tier.close()
