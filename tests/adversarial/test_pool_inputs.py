"""`HostChunkPool`'s public row methods with chunk ids or slot ranges outside the pool.

`write_blocks` / `read_blocks` / `slots` are public (the engine, the torch worker and
canonical views call them with checked ids; other callers may not): a negative chunk id
or start slot used to index numpy from the end, so a write landed silently in another
chunk's row, and a range past the chunk list surfaced as a raw IndexError."""

from __future__ import annotations

import numpy as np
import pytest

from jax_kvoffload.hostmem import HostChunkPool, HostPoolError

BAD = {
    "chunk -1": ([-1], 0, 1),
    "chunk past the pool": ([4], 0, 1),
    "start slot -1": ([0], -1, 1),
    "more blocks than the chunks hold": ([0], 0, 3),
    "start past the chunks": ([0, 1], 4, 1),
    "negative count": ([0], 0, -1),
}


def pool() -> HostChunkPool:
    return HostChunkPool(4, {0: 8}, 2)


@pytest.mark.parametrize("name", sorted(BAD))
def test_writes_outside_the_chunks_are_refused_and_touch_nothing(name):
    chunks, first, n = BAD[name]
    p = pool()
    if n >= 0:  # a write's count is its data's rows
        with pytest.raises(HostPoolError):
            p.write_blocks(0, chunks, first, np.full((n, 8), 7, np.uint8))
        assert not p.rows(0).any(), "a refused write changed the rows"
    out = np.zeros((max(n, 1), 8), np.uint8)
    with pytest.raises(HostPoolError):
        p.read_blocks(0, chunks, first, n, out)
    with pytest.raises(HostPoolError):
        p.slots(chunks, first, n)


def test_valid_ranges_still_work_mid_chunk():
    p = pool()
    data = np.arange(24, dtype=np.uint8).reshape(3, 8)
    p.write_blocks(0, [2, 0], 1, data)  # slot 1 of chunk 2, then both slots of chunk 0
    assert (p.rows(0)[2, 8:] == data[0]).all() and (p.rows(0)[0] == data[1:].ravel()).all()
    out = np.zeros((3, 8), np.uint8)
    np.testing.assert_array_equal(p.read_blocks(0, [2, 0], 1, 3, out), data)
    assert p.slots([3], 0, 0).size == 0
