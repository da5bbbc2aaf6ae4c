"""Sliding-window groups (issue 12, defect 7): what `lookup` reports as loadable loads.

A group with a window of W chunks needs only the last W chunks before the prefix end;
vLLM's scheduler loads only those (`update_state_after_alloc` starts the load at the
first block inside the window). `lookup` counts the longest prefix whose trailing W
chunks are stored, and `load` of that prefix loads those W chunks and leaves the other
blocks as they are.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.faults._helpers import (
    BS,
    NB,
    blocks,
    config,
    expected,
    hashes,
    offloader,
    pins,
    write_blocks,
)


def test_lookup_then_load_of_a_window_group():
    cfg = config(window=4 * BS, chunks=8)  # 16 tokens = 4 blocks = 2 chunks of 2 blocks
    assert cfg.groups[0].sliding_window_size_in_chunks == 2
    off = offloader(cfg)
    h = hashes("a", 10)  # 5 chunks; a store keeps only the last 2
    write_blocks(off, list(range(10)), h)
    assert off.wait([off.store(h, list(range(10)))])[0].success
    n = off.lookup(h)
    assert n == 10
    dst = list(range(12, 22))
    before = blocks(off, dst)
    job = off.load(h[:n], dst)
    assert off.wait([job])[0].success
    after = blocks(off, dst)
    np.testing.assert_array_equal(after[:, 6:], expected(h[6:10]))  # the window
    np.testing.assert_array_equal(after[:, :6], before[:, :6])  # untouched
    assert pins(off) == (0, 0)
    off.close()


@pytest.mark.parametrize("seed", range(4))
def test_whatever_lookup_counts_loads(seed):
    rng = np.random.default_rng(seed)
    print(f"seed={seed}")
    cfg = config(window=int(rng.integers(1, 25)), chunks=12)  # tokens
    window_chunks = cfg.groups[0].sliding_window_size_in_chunks
    off = offloader(cfg)
    prompts = [hashes(f"p{seed}-{i}", int(rng.integers(2, 12))) for i in range(4)]
    for h in prompts:
        ids = list(range(len(h)))
        write_blocks(off, ids, h)
        job = off.store(h, ids)
        if job is not None:
            off.wait([job])
    for h in prompts:
        for cut in range(0, len(h) + 1):
            n = off.lookup(h[:cut])
            if not n:
                continue
            dst = list(range(NB - n, NB))
            before = blocks(off, dst)
            (result,) = off.wait([off.load(h[:n], dst)])
            assert result.success, result
            start = max(0, n - window_chunks * 2)
            after = blocks(off, dst)
            np.testing.assert_array_equal(after[:, start:], expected(h[start:n]))
            np.testing.assert_array_equal(after[:, :start], before[:, :start])
    assert pins(off) == (0, 0)
    off.close()
