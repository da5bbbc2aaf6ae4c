"""The canonical relayout (`CanonicalGroupPlan`) against a naive fragment-by-fragment
reference: exact bytes, writer rotation, padding, and both the slice path (runs of
slots) and the fancy-index path (scattered slots) of the strided host copies it runs
(tests/hostmem/test_strided.py)."""

from __future__ import annotations

import numpy as np
import pytest

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
    TransferError,
    plan_for_group,
    plan_for_padded_page,
)


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


@pytest.mark.parametrize("slots_kind", ["runs", "scattered"])
def test_copies_split_over_threads_give_the_same_bytes(monkeypatch, slots_kind):
    from jax_kvoffload.hostmem import _strided

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
