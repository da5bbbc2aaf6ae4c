"""The host pools behind `HostPool`: the same bytes through either pool, and what the
pinned-row pool promises on top (stores adopted without a host copy, rows no larger
than a chunk, partial stores keep the other bytes, rows for tiers)."""

from __future__ import annotations

import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload.errors import KVOffloadTypeError
from jax_kvoffload.transfer import (
    CanonicalPoolView,
    ChunkRowPool,
    GroupCaches,
    GroupTransfer,
    HostChunkPool,
    HostPool,
    HostPoolError,
    PinnedRowPool,
    TransferEngine,
)

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


def test_pinned_pool_partial_stores_keep_the_other_bytes():
    pool = PinnedRowPool(4, {0: 8}, 3)
    whole = np.arange(24, dtype=np.uint8).reshape(3, 8)
    pool.write_blocks(0, [2], 0, whole)  # adopted
    pool.write_blocks(0, [2], 1, np.full((1, 4), 255, np.uint8))  # one slot, half width
    assert (pool.adopted, pool.copied) == (1, 1)
    want = whole.copy()
    want[1, :4] = 255
    np.testing.assert_array_equal(pool.chunk_row(0, 2).reshape(3, 8), want)
    assert whole[1, 0] == 8  # the adopted array itself was never written
    out = np.zeros((2, 8), np.uint8)
    pool.read_blocks(0, [2, 0], 2, 2, out)  # slot 2 of chunk 2, then slot 0 of chunk 0
    np.testing.assert_array_equal(out, [want[2], np.zeros(8, np.uint8)])  # unwritten: 0


def test_rows_for_tiers_are_the_rows():
    for cls in (HostChunkPool, PinnedRowPool):
        pool = cls(3, {0: 4, 1: 6}, 2)
        dst = pool.chunk_row_for_write(1, 2)
        assert dst.shape == (12,) and dst.flags.writeable
        dst[:] = np.arange(12, dtype=np.uint8)
        out = np.zeros((2, 6), np.uint8)
        pool.read_blocks(1, [2], 0, 2, out)
        np.testing.assert_array_equal(out.reshape(-1), np.arange(12))
        np.testing.assert_array_equal(pool.chunk_row(1, 2), np.arange(12))
        with pytest.raises(HostPoolError, match="outside"):
            pool.chunk_row(0, 3)
        with pytest.raises(HostPoolError, match="no host rows"):
            pool.chunk_row(2, 0)


def test_chunk_rows_hold_each_process_area_and_nothing_else():
    """Two workers' windows on one region of rows (vLLM's layout): each writes only its
    own area; a row is every worker's bytes, the padding untouched."""
    row = 64
    region = np.full(3 * row, 0xEE, np.uint8)
    widths = {0: 6, 1: 4}  # two tensors, two blocks per chunk: 20 bytes per area
    w0 = ChunkRowPool(region, 3, widths, 2, row_stride=row, area_offset=0)
    w1 = ChunkRowPool(region, 3, widths, 2, row_stride=row, area_offset=20)
    w0.write_blocks(1, [2], 0, np.full((2, 4), 1, np.uint8))
    w1.write_blocks(0, [0, 2], 1, np.full((2, 6), 2, np.uint8))  # chunk 0 slot 1, chunk 2 slot 0
    want = np.full(3 * row, 0xEE, np.uint8)
    want[2 * row + 12 : 2 * row + 20] = 1  # w0's tensor 1 rows of chunk 2
    want[0 * row + 20 + 6 : 0 * row + 20 + 12] = 2  # w1's tensor 0, chunk 0, slot 1
    want[2 * row + 20 : 2 * row + 26] = 2  # w1's tensor 0, chunk 2, slot 0
    np.testing.assert_array_equal(region, want)
    out = np.zeros((2, 6), np.uint8)
    np.testing.assert_array_equal(w1.read_blocks(0, [0, 2], 1, 2, out), 2)
    assert np.shares_memory(w0.chunk_row(1, 2), region)
    np.testing.assert_array_equal(w0.chunk_row(1, 2), 1)
    with pytest.raises(HostPoolError, match="do not fit a row"):
        ChunkRowPool(region, 3, widths, 2, row_stride=row, area_offset=50)
