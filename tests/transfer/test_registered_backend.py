"""The engine takes a kernel backend registered at run time by its name (CONTRIBUTING.md,
"Adding a kernel backend"), as `pallas_kernels` does; an unknown name is refused."""

from __future__ import annotations

import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload.hostmem import HostChunkPool
from jax_kvoffload.transfer import GroupCaches, GroupTransfer, TransferEngine, TransferError
from pallas_kernels.blocks.backends import register_backend, unregister_backend
from tests.pallas_kernels.cases import Case, make_caches
from tests.pallas_kernels.test_backend_registration import record


def test_the_engine_runs_a_registered_backend():
    case = Case("nhd", "uint8", 1, 4, 8, 3)
    arrays = make_caches(case)
    before = np.asarray(arrays[0]).copy()
    gc = GroupCaches(arrays, pk.KVLayout.nhd())
    with pytest.raises(TransferError, match="backend must be one of"):
        TransferEngine({0: gc}, HostChunkPool(2, {0: gc.block_bytes}, 2), backend="words")
    register_backend(record("words"))
    try:
        pool = HostChunkPool(2, {0: gc.block_bytes}, 2)
        with TransferEngine({0: gc}, pool, backend="words", max_bucket=2) as engine:
            engine.submit_store(1, [GroupTransfer(0, (1, 2), (0,))])
            assert engine.wait([1])[0].success
            engine.submit_load(2, [GroupTransfer(0, (7, 8), (0,))])
            assert engine.wait([2])[0].success
            after = np.asarray(engine.arrays(0)[0])
        np.testing.assert_array_equal(after[[7, 8]], before[[1, 2]])
    finally:
        unregister_backend("words")
