"""`PinnedRowPool` and `ChunkRowPool` (the HostPool seam's other implementations) with
chunk ids and slot ranges outside the pool, as `test_pool_inputs.py` does for
`HostChunkPool`: a negative start slot used to index the chunk list from its end (a
write landed silently in the wrong slot), and a range past the chunk list wrote the
slots it could before failing with a raw IndexError. A `ChunkRowPool` shares its buffer
with other processes' areas: every byte outside the slots written must stay as it was."""

from __future__ import annotations

import numpy as np
import pytest

from jax_kvoffload.hostmem import ChunkRowPool, HostPoolError, PinnedRowPool

BAD = {
    "chunk -1": ([-1], 0, 1),
    "chunk past the pool": ([4], 0, 1),
    "start slot -1": ([0], -1, 1),
    "start slot -1 of two chunks": ([0, 1], -1, 2),
    "more blocks than the chunks hold": ([0], 0, 3),
    "start past the chunks": ([0, 1], 4, 1),
}
STRIDE, AREA_AT = 48, 8  # rows of 48 bytes; this process's 16 bytes from offset 8


def noise(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def make(kind: str):
    if kind == "pinned":
        return PinnedRowPool(4, {0: 8}, 2), None
    buffer = noise(4 * STRIDE)
    return ChunkRowPool(buffer, 4, {0: 8}, 2, row_stride=STRIDE, area_offset=AREA_AT), buffer


def snapshot(pool, buffer) -> np.ndarray:
    if buffer is not None:
        return buffer.copy()
    return np.concatenate([pool.chunk_row(0, c) for c in range(pool.num_chunks)])


@pytest.mark.parametrize("kind", ["pinned", "rows"])
@pytest.mark.parametrize("name", sorted(BAD))
def test_writes_outside_the_chunks_are_refused_and_touch_nothing(kind, name):
    chunks, first, n = BAD[name]
    pool, buffer = make(kind)
    before = snapshot(pool, buffer)
    with pytest.raises(HostPoolError):
        pool.write_blocks(0, chunks, first, np.full((n, 8), 7, np.uint8))
    np.testing.assert_array_equal(snapshot(pool, buffer), before, err_msg="a refused write wrote")
    out = np.zeros((n, 8), np.uint8)
    with pytest.raises(HostPoolError):
        pool.read_blocks(0, chunks, first, n, out)


@pytest.mark.parametrize("kind", ["pinned", "rows"])
def test_valid_ranges_write_their_slots_and_nothing_else(kind):
    pool, buffer = make(kind)
    data = noise(24, seed=1).reshape(3, 8)
    pool.write_blocks(0, [2, 0], 1, data)  # slot 1 of chunk 2, then both slots of chunk 0
    out = np.zeros((3, 8), np.uint8)
    np.testing.assert_array_equal(pool.read_blocks(0, [2, 0], 1, 3, out), data)
    if buffer is not None:
        want = noise(4 * STRIDE)  # what the buffer held
        want[2 * STRIDE + AREA_AT + 8 : 2 * STRIDE + AREA_AT + 16] = data[0]
        want[AREA_AT : AREA_AT + 16] = data[1:].ravel()
        np.testing.assert_array_equal(buffer, want)
    else:
        assert not pool.chunk_row(0, 2)[:8].any() and not pool.chunk_row(0, 1).any()


def test_a_row_pool_refuses_a_negative_chunk_count():
    with pytest.raises(HostPoolError):
        ChunkRowPool(np.zeros(64, np.uint8), -1, {0: 8}, 2, row_stride=16)
