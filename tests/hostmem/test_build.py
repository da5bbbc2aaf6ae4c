"""`build_host_pool`, the one place a host pool is built: which class for which kind, a
pool over a shared region in either layout, and nothing left mapped when the pool cannot
be built over its region."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from jax_kvoffload.errors import KVOffloadTypeError
from jax_kvoffload.hostmem import (
    ChunkRowPool,
    HostChunkPool,
    HostPoolError,
    PinnedRowPool,
    SharedRows,
    build_host_pool,
)
from jax_kvoffload.hostmem._shared_region import memfd_name
from jax_kvoffload.hostmem._shm_memfd import unsupported
from tests.hostmem._forked import memfd_mappers

needs_memfd = pytest.mark.skipif(unsupported() is not None, reason=str(unsupported()))


def unique() -> str:
    return f"test-{uuid.uuid4().hex}"  # other helpers' tests share this machine's names


@pytest.mark.parametrize(("kind", "cls"), [("numpy", HostChunkPool), ("pinned", PinnedRowPool)])
def test_each_kind_is_its_pool_in_this_process_memory(kind, cls):
    pool, region = build_host_pool(3, {0: 8, 1: 4}, 2, kind=kind)
    assert type(pool) is cls and region is None
    assert (pool.num_chunks, pool.blocks_per_chunk, dict(pool.bytes_per_block)) == (
        3,
        2,
        {0: 8, 1: 4},
    )


def test_the_default_is_the_numpy_pool():
    pool, region = build_host_pool(2, {0: 8}, 1)
    assert type(pool) is HostChunkPool and region is None


def test_an_unknown_kind_is_refused_naming_the_kinds():
    with pytest.raises(HostPoolError, match=r"kind='gpu' is not a host pool; use one of"):
        build_host_pool(2, {0: 8}, 1, kind="gpu")
    with pytest.raises(KVOffloadTypeError, match="kind must be a pool name"):
        build_host_pool(2, {0: 8}, 1, kind=None)


def test_pinned_rows_cannot_be_shared():
    shared = SharedRows(unique(), 2, 0)
    with pytest.raises(HostPoolError, match="kind='pinned' cannot be shared"):
        build_host_pool(2, {0: 8}, 1, kind="pinned", shared=shared)


def test_region_sizes_follow_the_layout():
    assert SharedRows("x", 2, 0).region_bytes(3, {0: 8, 1: 4}, 2) == 3 * 2 * 12
    assert SharedRows("x", 3, 1, row_stride=100).region_bytes(3, {0: 8}, 2) == 300


@needs_memfd
def test_a_shared_pool_lives_in_its_region():
    name = unique()
    pool, region = build_host_pool(3, {0: 8, 1: 4}, 2, shared=SharedRows(name, 2, 1))
    try:
        assert type(pool) is HostChunkPool
        assert (region.nbytes, region.expected_attachments, region.slot) == (72, 2, 1)
        pool.write_blocks(1, [2], 0, np.full((2, 4), 7, np.uint8))
        assert np.shares_memory(pool.rows(1), region.array)
        assert (region.array[48 + 16 :] == 7).all() and not region.array[: 48 + 16].any()
    finally:
        del pool
        region.close()
    assert memfd_mappers(memfd_name(name)) == []


@needs_memfd
def test_strided_rows_give_this_process_its_area_of_every_row():
    name = unique()
    shared = SharedRows(name, 3, 1, row_stride=32, area_offset=16)
    pool, region = build_host_pool(2, {0: 4}, 2, shared=shared)
    try:
        assert type(pool) is ChunkRowPool and region.nbytes == 64
        pool.write_blocks(0, [1], 0, np.full((2, 4), 9, np.uint8))
        want = np.zeros(64, np.uint8)
        want[32 + 16 : 32 + 24] = 9
        np.testing.assert_array_equal(region.array, want)
    finally:
        del pool
        region.close()


@needs_memfd
@pytest.mark.parametrize("row_stride", [None, 8])
def test_a_pool_that_cannot_be_built_leaves_no_region_behind(row_stride):
    # A width of 0 passes the region's checks but not the pool's; an area wider than
    # its row is refused by ChunkRowPool. Either way the region is unmapped again.
    name = unique()
    widths = {0: 8, 1: 0} if row_stride is None else {0: 8}
    shared = SharedRows(name, 2, 0, row_stride=row_stride)
    with pytest.raises(HostPoolError):
        build_host_pool(2, widths, 2, shared=shared)
    assert memfd_mappers(memfd_name(name)) == []
