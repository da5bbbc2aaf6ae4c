"""The host pools on their own: a pinned-row pool's partial stores keep the other bytes,
rows for tiers are the rows, and vLLM's shared-region layout gives each process its
area of every row and nothing else. Through the transfer engine:
tests/transfer/test_engine_pools.py."""

from __future__ import annotations

import numpy as np
import pytest

from jax_kvoffload.hostmem import ChunkRowPool, HostChunkPool, HostPoolError, PinnedRowPool


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
