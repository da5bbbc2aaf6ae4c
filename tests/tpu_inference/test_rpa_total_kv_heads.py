"""`total_kv_heads` that is no head count is refused as such, before the RPA shape
check: before, 0 raised a bare ZeroDivisionError from the check's message, and -1 a
`CacheConfigMismatchError` that blamed the (correct) caches."""

from __future__ import annotations

import pytest

from jax_kvoffload import KVOffloader
from jax_kvoffload.offloader import CacheConfigMismatchError
from jax_kvoffload.offloader._checks import OffloaderError
from tests.adversarial.test_cache_contradictions import Model, config, rpa_caches


@pytest.mark.parametrize("heads", [0, -1, -2])
def test_a_total_kv_heads_below_one_is_refused_naming_it(heads):
    m = Model(2, 128, 4, 1, "bfloat16", "rpa")
    cfg = config(m)
    KVOffloader(cfg, rpa_caches(m, 2, 128), backend="xla", total_kv_heads=2).close()
    with pytest.raises(OffloaderError, match=f"total_kv_heads={heads} must be >= 1") as e:
        KVOffloader(cfg, rpa_caches(m, 2, 128), backend="xla", total_kv_heads=heads)
    assert not isinstance(e.value, CacheConfigMismatchError)  # the caches are right
