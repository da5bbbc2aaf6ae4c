"""The strided host copies (`_strided`, `CanonicalGroupPlan`, `HostChunkPool`) against a
naive fragment-by-fragment reference: exact bytes, writer rotation, padding, and both the
slice path (runs of slots) and the fancy-index path (scattered slots)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_kvoffload.config import FullAttentionSpec
from jax_kvoffload.config.canonical import (
    CanonicalPageMapping,
    CopyRun,
    KVTensorView,
    RankContext,
    layer_mapping,
)
from jax_kvoffload.transfer import (
    CanonicalGroupPlan,
    HostChunkPool,
    HostPoolError,
    TransferError,
    plan_for_group,
    plan_for_padded_page,
)
from jax_kvoffload.transfer._strided import StridedCopy, merge_copies, segments


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


def naive_store(plan_layers, canonical, slots, data):
    for k, s in enumerate(slots):
        for m, lo, co in plan_layers:
            if not m.is_writer(int(s)):
                continue
            for lf, cf, n in m.fragments():
                canonical[s, co + cf : co + cf + n] = data[k, lo + lf : lo + lf + n]


def naive_load(plan_layers, canonical, slots, out):
    for k, s in enumerate(slots):
        for m, lo, co in plan_layers:
            for lf, cf, n in m.fragments():
                out[k, lo + lf : lo + lf + n] = canonical[s, co + cf : co + cf + n]


def rank_layers(form, tp, total, rank, num_layers):
    spec = FullAttentionSpec(
        block_size=4, num_kv_heads=max(1, total // tp), head_size=2, dtype="bfloat16"
    )
    kind, order = form.split("-")
    make = KVTensorView.split if kind == "split" else KVTensorView.packed
    view = make(8, max(1, total // tp), 4, 2, 2, order)
    m = layer_mapping(spec, view, 8, RankContext(tp, 1, 1, 1, total, rank))
    page, cpage = m.local_page_size_bytes, m.canonical_page_size_bytes
    return [(m, i * page, i * cpage) for i in range(num_layers)], page, cpage


@pytest.mark.parametrize("form", ["split-nhd", "packed-nhd", "split-hnd"])
@pytest.mark.parametrize(("tp", "total", "rank"), [(2, 4, 1), (4, 2, 3), (4, 4, 0)])
@pytest.mark.parametrize("slots_kind", ["runs", "scattered"])
def test_plan_matches_the_naive_relayout(form, tp, total, rank, slots_kind):
    layers, page, cpage = rank_layers(form, tp, total, rank, num_layers=3)
    plan = CanonicalGroupPlan(layers, 3 * page, 3 * cpage)
    rng = np.random.default_rng(tp * 10 + rank)
    if slots_kind == "runs":
        slots = np.concatenate([np.arange(8, 20), np.arange(40, 45), np.arange(2, 4)])
    else:  # more than 32 runs: the fancy-index path
        slots = rng.permutation(64)[:50]
    data = rng.integers(0, 256, (slots.size, 3 * page), dtype=np.uint8)
    ours = rng.integers(0, 256, (64, 3 * cpage), dtype=np.uint8)
    ref = ours.copy()
    written = plan.store(ours, slots, data)
    naive_store(layers, ref, slots, data)
    np.testing.assert_array_equal(ours, ref)
    writer = layers[0][0].is_writer
    assert written == sum(writer(int(s)) for s in slots) * 3 * page
    out, out_ref = np.empty_like(data), np.zeros_like(data)
    plan.load(ours, slots, out)
    naive_load(layers, ours, slots, out_ref)
    np.testing.assert_array_equal(out, out_ref)


def test_a_padded_page_stores_the_mapped_bytes_and_loads_leave_the_padding_alone():
    # vLLM's worker moves only the unpadded page: a load writes no byte of the padding.
    ((m, _, _),), _, _ = rank_layers("split-nhd", 2, 4, 1, num_layers=1)
    plan = plan_for_padded_page(m, m.local_page_size_bytes + 24)
    data = np.full((3, m.local_page_size_bytes + 24), 7, dtype=np.uint8)
    canonical = np.zeros((4, m.canonical_page_size_bytes), dtype=np.uint8)
    assert plan.store(canonical, np.array([0, 1, 2]), data) == 3 * m.local_page_size_bytes
    assert (canonical[:3] == 7).sum() == 3 * m.local_page_size_bytes
    out = np.full_like(data, 9)
    plan.load(canonical, np.array([0, 1, 2]), out)
    assert (out[:, : m.local_page_size_bytes] == 7).all()
    assert (out[:, m.local_page_size_bytes :] == 9).all()
    with pytest.raises(TransferError, match="does not fit"):
        plan_for_padded_page(m, m.local_page_size_bytes - 1)


def test_a_row_the_mappings_do_not_cover_is_refused():
    layers, page, cpage = rank_layers("split-nhd", 2, 4, 0, num_layers=2)
    with pytest.raises(TransferError, match="mapped bytes"):
        CanonicalGroupPlan(layers, 2 * page + 8, 2 * cpage)
    with pytest.raises(TransferError, match="more than once"):
        CanonicalGroupPlan([layers[0], layers[0]], page, cpage)


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
    assert plan_for_group  # exported alongside


@pytest.mark.parametrize("slots_kind", ["runs", "scattered"])
def test_copies_split_over_threads_give_the_same_bytes(monkeypatch, slots_kind):
    from jax_kvoffload.transfer import _strided

    monkeypatch.setenv("JAX_KVOFFLOAD_COPY_THREADS", "3")
    monkeypatch.setattr(_strided, "_PARALLEL_BYTES", 64)  # split even tiny copies
    layers, page, cpage = rank_layers("split-nhd", 2, 4, 1, num_layers=2)
    plan = CanonicalGroupPlan(layers, 2 * page, 2 * cpage)
    rng = np.random.default_rng(1)
    slots = np.arange(3, 40) if slots_kind == "runs" else rng.permutation(80)[:60]
    data = rng.integers(0, 256, (slots.size, 2 * page), dtype=np.uint8)
    ours = np.zeros((80, 2 * cpage), dtype=np.uint8)
    ref = ours.copy()
    plan.store(ours, slots, data)
    naive_store(layers, ref, slots, data)
    np.testing.assert_array_equal(ours, ref)
    out = np.empty_like(data)
    plan.load(ours, slots, out)
    out_ref = np.zeros_like(data)
    naive_load(layers, ours, slots, out_ref)
    np.testing.assert_array_equal(out, out_ref)


def test_a_failing_piece_is_raised_after_every_piece_ended(monkeypatch):
    from jax_kvoffload.transfer import _strided

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


def test_runs_outside_their_pages_or_rows_are_refused():
    # Found in review: such runs used to write past the canonical rows.
    past_page = CanonicalPageMapping(8, 8, (CopyRun(0, 8, 8, 1, 8, 8),))
    with pytest.raises(TransferError, match="reaches byte 8 of a 8-byte page and 16"):
        plan_for_group([past_page], [8])
    whole = CanonicalPageMapping(16, 16, (CopyRun(0, 0, 16, 1, 16, 16),))
    with pytest.raises(TransferError, match="do not fit rows"):
        CanonicalGroupPlan([(whole, 0, 0)], 16, 8)
    plan = CanonicalGroupPlan([(whole, 0, 0)], 16, 16)
    with pytest.raises(TransferError, match=r"canonical must be \[n, 16\] uint8"):
        plan.store(np.zeros((4, 8), np.uint8), np.array([0]), np.zeros((1, 16), np.uint8))
    with pytest.raises(TransferError, match=r"out must be \[n, 16\]"):
        plan.load(np.zeros((4, 16), np.uint8), np.array([0]), np.zeros((1, 16), np.int16))


def test_a_transposing_mapping_is_not_taken_for_a_plain_copy():
    # Local [2 heads, 2 tokens] of 2-byte rows -> canonical [2 tokens, 2 heads]: same
    # widths, one folded family at offset 0, but not the identity (found in review).
    runs = (CopyRun(0, 0, 2, 2, 2, 4), CopyRun(4, 2, 2, 2, 2, 4))
    plan = plan_for_group([CanonicalPageMapping(8, 8, runs)], [8])
    assert not plan.identity
    canonical = np.zeros((1, 8), np.uint8)
    plan.store(canonical, np.array([0]), np.arange(8, dtype=np.uint8)[None])
    assert canonical[0].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert plan_for_group([CanonicalPageMapping(8, 8, (CopyRun(0, 0, 8, 1, 8, 8),))], [8]).identity


FORK_SCRIPT = """
import os, signal, sys, time
import numpy as np
from jax_kvoffload.transfer import _strided

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
    from jax_kvoffload.transfer import _strided

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
