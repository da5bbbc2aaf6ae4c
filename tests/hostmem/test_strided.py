"""The strided host copies (`_strided`, `HostChunkPool`): merged copy families keep
exactly their fragments, slot runs split where either side jumps, pools read and write
runs as fancy indexing would, and the copy threads (failures, forks, a refusing pool).
The canonical relayout built on them: tests/transfer/test_canonical_plan.py."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_kvoffload.hostmem import HostChunkPool, HostPoolError
from jax_kvoffload.hostmem._strided import StridedCopy, merge_copies, segments
from jax_kvoffload.transfer import plan_for_group


def fragments_of(copies):
    out = set()
    for c in copies:
        for i in range(c.layers):
            for j in range(c.fragments):
                lo = c.local + i * c.local_steps[0] + j * c.local_steps[1]
                co = c.canonical + i * c.canonical_steps[0] + j * c.canonical_steps[1]
                out.add((lo, co, c.size))
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(0, 3), st.booleans()),
        min_size=1,
        max_size=12,
    )
)
def test_merging_keeps_exactly_the_same_fragments(layers):
    # Each layer: fragment size, count, a gap, and whether its step breaks the pattern.
    copies, lo, co = [], 0, 0
    for size, n, gap, odd in layers:
        copies.append(StridedCopy(lo, co, size, 1, n, (0, size + gap), (0, 2 * size + gap)))
        lo += n * (size + gap) + (3 if odd else 0)
        co += n * (2 * size + gap) + (5 if odd else 0)
    merged = merge_copies(copies)
    assert fragments_of(merged) == fragments_of(copies)
    assert len(merged) <= len(copies)


def test_uniform_layers_fold_into_one_copy():
    copies = [StridedCopy(100 * i, 300 * i, 10, 1, 4, (0, 20), (0, 40)) for i in range(8)]
    (one,) = merge_copies(copies)
    assert (one.layers, one.local_steps, one.canonical_steps) == (8, (100, 20), (300, 40))


def test_segments_split_where_either_side_jumps():
    slots = np.array([4, 5, 6, 10, 11, 3])
    pos = np.array([0, 1, 2, 3, 5, 6])
    assert segments(slots, pos, 1) == [(4, 0, 3), (10, 3, 1), (11, 5, 1), (3, 6, 1)]
    assert segments(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 1) == []


@pytest.mark.parametrize("chunk_ids", [[5, 6, 7, 8], [9, 2, 30, 4]])
def test_pool_reads_and_writes_slot_runs_like_fancy_indexing(chunk_ids):
    pool = HostChunkPool(32, {0: 24, 1: 8}, 4)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (13, 24), dtype=np.uint8)
    pool.write_blocks(0, chunk_ids, 1, data)  # slots 1..13 across four chunks
    flat = pool.rows(0).reshape(-1, 24)
    k = np.arange(1, 14)
    expected_slots = np.asarray(chunk_ids)[k // 4] * 4 + k % 4
    np.testing.assert_array_equal(flat[expected_slots], data)
    out = np.empty_like(data)
    assert pool.read_blocks(0, chunk_ids, 1, 13, out) is out
    np.testing.assert_array_equal(out, data)
    assert not pool.rows(1).any()


def test_a_pool_over_a_buffer_carves_groups_in_order_and_checks_the_size():
    need = HostChunkPool.nbytes_for(3, {0: 8, 1: 4}, 2)
    buf = np.zeros(need, dtype=np.uint8)
    pool = HostChunkPool(3, {0: 8, 1: 4}, 2, buffer=buf)
    pool.rows(1)[...] = 1
    assert buf[: 3 * 2 * 8].sum() == 0 and (buf[3 * 2 * 8 :] == 1).all()
    with pytest.raises(HostPoolError, match="at least"):
        HostChunkPool(3, {0: 8, 1: 4}, 2, buffer=buf[:-1])
    assert plan_for_group  # the canonical plan that sizes such rows (transfer)


def test_a_failing_piece_is_raised_after_every_piece_ended(monkeypatch):
    from jax_kvoffload.hostmem import _strided

    monkeypatch.setenv("JAX_KVOFFLOAD_COPY_THREADS", "4")
    ended = []

    def ok(i):
        ended.append(i)

    def boom():
        raise OSError("disk on fire")

    with pytest.raises(OSError, match="on fire"):
        _strided._run([boom, *(lambda i=i: ok(i) for i in range(5))])
    assert sorted(ended) == list(range(5))
    monkeypatch.setenv("JAX_KVOFFLOAD_COPY_THREADS", "many")
    with pytest.raises(ValueError, match="whole number"):
        _strided.copy_threads()


FORK_SCRIPT = """
import os, signal, sys, time
import numpy as np
from jax_kvoffload.hostmem import _strided

os.environ["JAX_KVOFFLOAD_COPY_THREADS"] = "2"  # one pool thread: the child reuses it
_strided._PARALLEL_BYTES = 64  # split even tiny copies
src = np.arange(4096, dtype=np.uint8).reshape(64, 64)
dst = np.zeros_like(src)
_strided.copy_rows(dst, np.arange(64), src, np.arange(64), 1)  # the parent's pool
pid = os.fork()
if pid == 0:  # the inherited pool has no threads: this used to hang
    out = np.zeros_like(src)
    _strided.copy_rows(out, np.arange(64), src, np.arange(64), 1)
    os._exit(0 if (out == src).all() else 1)
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.05)
os.kill(pid, signal.SIGKILL)
sys.exit("the forked child hung copying")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_copies_with_its_own_threads():
    # In a fresh process: forking this one (jax running) trips jax's own fork warning.
    done = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_pool_that_refuses_work_leaves_the_copy_to_this_thread(monkeypatch):
    from jax_kvoffload.hostmem import _strided

    class Refusing:
        def submit(self, fn):
            raise RuntimeError("cannot schedule new futures after shutdown")

    monkeypatch.setattr(_strided, "_pool", lambda workers: Refusing())
    ran = []
    _strided._run([lambda i=i: ran.append(i) for i in range(4)])
    assert ran == [0, 1, 2, 3]


def test_pools_refuse_buffers_and_outputs_that_would_copy_or_cast():
    with pytest.raises(HostPoolError, match="contiguous, writable"):
        HostChunkPool(2, {0: 8}, 1, buffer=np.zeros(64, np.uint8)[::2])
    pool = HostChunkPool(2, {0: 8}, 1)
    with pytest.raises(HostPoolError, match=r"out must be \[1, w\] uint8 with 0 < w <= 8"):
        pool.read_blocks(0, [0], 0, 1, np.zeros((1, 8), np.int16))
    with pytest.raises(HostPoolError, match=r"out must be \[1, w\] uint8 with 0 < w <= 8"):
        pool.read_blocks(0, [0], 0, 1, np.zeros((1, 9), np.uint8))  # wider than a slot
