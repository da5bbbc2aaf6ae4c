"""The transfer engine over the host pools behind `HostPool`: the same bytes through
either pool, and what the pinned-row pool promises on top (stores adopted without a
host copy, rows no larger than a chunk). The pools on their own:
tests/hostmem/test_pools.py."""

from __future__ import annotations

import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload.errors import KVOffloadTypeError
from jax_kvoffload.hostmem import HostChunkPool, HostPool, PinnedRowPool
from jax_kvoffload.transfer import CanonicalPoolView, GroupCaches, GroupTransfer, TransferEngine

from .test_engine import random_arrays

NB, BPC = 16, 2
SHAPE = (NB, 4, 2, 8)

POOLS = {"numpy": HostChunkPool, "pinned": PinnedRowPool}


def engine_with(pool_cls, chunks=8, bpc=BPC, max_bucket=4, seed=0):
    arrays = random_arrays(SHAPE, np.uint16, 2, seed=seed)
    gc = GroupCaches(arrays, pk.KVLayout.nhd())
    pool = pool_cls(chunks, {0: gc.block_bytes}, bpc)
    engine = TransferEngine({0: gc}, pool, backend="xla", max_bucket=max_bucket)
    return engine, pool, [np.asarray(a).copy() for a in arrays]


def test_every_pool_is_a_host_pool():
    assert issubclass(HostChunkPool, HostPool)
    assert issubclass(PinnedRowPool, HostPool)
    assert issubclass(CanonicalPoolView, HostPool)
    with pytest.raises(TypeError):
        HostPool()  # abstract: the contract is in its docstring


def test_the_engine_refuses_a_duck_typed_pool():
    class Duck:  # the attributes the engine used to look for, and nothing else
        bytes_per_block = {0: 256}  # noqa: RUF012
        blocks_per_chunk = 2
        num_chunks = 4

    gc = GroupCaches(random_arrays(SHAPE, np.uint16, 2), pk.KVLayout.nhd())
    with pytest.raises(KVOffloadTypeError, match="HostPool"):
        TransferEngine({0: gc}, Duck(), backend="xla")


@pytest.mark.parametrize("bpc", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(POOLS))
def test_round_trip_is_bit_exact_through_either_pool(name, bpc):
    engine, _, before = engine_with(POOLS[name], bpc=bpc)
    blocks = [3, 9, 1, 14, 6, 0]  # 6 blocks: whole chunks for bpc 1, 2, 3
    chunks = list(range(len(blocks) // bpc))[::-1]  # reversed chunk order
    engine.submit_store(1, [GroupTransfer(0, tuple(blocks), tuple(chunks))])
    assert engine.wait([1])[0].success
    targets = [2, 4, 5, 7, 8, 10]
    engine.submit_load(2, [GroupTransfer(0, tuple(targets), tuple(chunks))])
    assert engine.wait([2])[0].success
    after = [np.asarray(a) for a in engine.arrays(0)]
    for layer in range(2):
        np.testing.assert_array_equal(after[layer][targets], before[layer][blocks])
        untouched = [b for b in range(NB) if b not in targets]
        np.testing.assert_array_equal(after[layer][untouched], before[layer][untouched])
    engine.close()


def test_pinned_pool_adopts_whole_chunks_without_a_host_copy():
    engine, pool, before = engine_with(PinnedRowPool, bpc=2, max_bucket=4)
    engine.submit_store(1, [GroupTransfer(0, (5, 6, 7, 8), (3, 1))])
    assert engine.wait([1])[0].success
    assert (pool.adopted, pool.copied) == (2, 0)
    row_bytes = pool.row_bytes(0)
    # The engine staged one array per chunk: each row keeps only itself alive, also
    # once the other chunk of the job is written again.
    assert pool.held_bytes == 2 * row_bytes
    engine.submit_store(2, [GroupTransfer(0, (0, 1), (3,))])
    assert engine.wait([2])[0].success
    assert pool.held_bytes == 2 * row_bytes
    row = pool.chunk_row(0, 1)
    assert row.shape == (row_bytes,) and not row.flags.writeable  # the device_put's array
    want = np.stack([before[0][[7, 8]], before[1][[7, 8]]], axis=1)  # [blocks, layers, ...]
    np.testing.assert_array_equal(row.view(np.uint16), want.reshape(-1))
    engine.close()
