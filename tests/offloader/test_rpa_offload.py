"""`KVOffloader` on ragged-paged-attention v3 caches, named by the config's
`cache_layout` (one device here; meshes: tests/canonical/test_rpa_canonical.py)."""

from __future__ import annotations

import numpy as np
import pytest

from jax_kvoffload import GroupCaches, KVOffloader
from jax_kvoffload.config import ConfigFieldError
from jax_kvoffload.errors import KVOffloadTypeError
from jax_kvoffload.transfer import TransferError
from tests.canonical.rpa_common import JAX_DTYPES, as_bits, hashes, rpa_bits, rpa_config, to_device


@pytest.mark.parametrize("dtype", list(JAX_DTYPES))
def test_rpa_caches_offload_and_load_every_bit(dtype):
    heads = 3  # fp8/int8: 6 slots in 8, two of them padding (noise here)
    before = rpa_bits(dtype, heads, 1, seed=1)
    with KVOffloader(rpa_config(dtype, heads), to_device(before), backend="xla") as off:
        h = hashes(dtype, 4)
        assert off.wait([off.store(h, [1, 2, 3, 4])])[0].success
        assert off.lookup(h) == 4
        assert off.wait([off.load(h, [8, 9, 10, 11])])[0].success
        after = [as_bits(a) for a in off.caches()]
    for a, b in zip(after, before, strict=True):
        b = as_bits(b)
        np.testing.assert_array_equal(a[8:12], b[1:5])  # padding moved as bytes
        np.testing.assert_array_equal(a[:8], b[:8])


def test_layout_by_name_in_group_caches_too():
    arrays = to_device(rpa_bits("bf16", 2, 1, seed=2))
    gc = GroupCaches(arrays, "rpa")
    assert gc.layout.name == "rpa"
    with pytest.raises(TransferError, match="'ragged'"):
        GroupCaches(arrays, "ragged")


def test_a_list_of_arrays_needs_the_layout_named():
    arrays = to_device(rpa_bits("bf16", 2, 1, seed=3))
    cfg = rpa_config("bf16", 2, extra={"cache_layout": None})
    # A TypeError, as a plain list always was (tests/faults/test_bad_input.py).
    with pytest.raises(KVOffloadTypeError, match="cache_layout"):
        KVOffloader(cfg, arrays, backend="xla")
    with pytest.raises(ConfigFieldError, match="not a cache layout"):
        KVOffloader(rpa_config("bf16", 2, extra={"cache_layout": "ragged"}), arrays)
