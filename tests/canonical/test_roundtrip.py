"""Cross-topology round trips through TransferEngine + CanonicalPoolView (CPU, xla backend).

Store under one topology, check the shared host rows are the single-device reference's
pages byte for byte, then load under other topologies and check every rank's cache is its
shard of the reference."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from .topology import FORMS, Model, Topology, load, reference, shard, store

BLOCKS = (5, 0, 3)  # permuted, non-contiguous, includes the last block
CHUNKS = (1, 0)  # 3 slots over 2 chunks of 2 blocks: starts mid-list, ends mid-chunk


def expected_rows(model: Model, topo: Topology) -> np.ndarray:
    """Canonical rows of BLOCKS: the reference's pages, layer after layer."""
    ref = reference(model, topo)
    layout, _ = FORMS[model.form]
    rows = []
    for b in BLOCKS:
        pages = [np.take(a, b, axis=layout.block_axis) for a in ref]
        rows.append(np.concatenate([np.ascontiguousarray(p).view(np.uint8).ravel() for p in pages]))
    return np.stack(rows)


def stored_rows(shared) -> np.ndarray:
    flat = shared.rows(0).reshape(shared.num_chunks * shared.blocks_per_chunk, -1)
    slots = [c * 2 + j for c in CHUNKS for j in range(2)][: len(BLOCKS)]
    return flat[slots]


def check_loaded(model: Model, topo: Topology, shared) -> None:
    ref = reference(model, topo)
    contexts, arrays = load(model, topo, shared, BLOCKS, CHUNKS)
    layout, _ = FORMS[model.form]
    for ctx, got in zip(contexts, arrays, strict=True):
        want = shard(model, ref, ctx)
        for g, w in zip(got, want, strict=True):
            for b in range(model.num_blocks):
                gb, wb = (
                    np.take(g, b, axis=layout.block_axis),
                    np.take(w, b, axis=layout.block_axis),
                )
                if b in BLOCKS:
                    np.testing.assert_array_equal(gb.view(np.uint16), wb.view(np.uint16))
                else:  # blocks outside the job stay untouched
                    assert not gb.view(np.uint16).any()


ATTENTION = ["packed-nhd", "packed-hnd", "split-nhd", "split-hnd", "first-nhd", "separate-hnd"]


@pytest.mark.parametrize("form", ATTENTION)
@pytest.mark.parametrize(("src", "dst"), [(2, (4, 1)), (4, (2,)), (1, (4,))])
def test_tp_round_trip(form, src, dst):
    model = Model(form, total_heads=4)
    shared, _ = store(model, Topology(tp=src), reference(model, Topology(tp=src)), BLOCKS, CHUNKS)
    np.testing.assert_array_equal(stored_rows(shared), expected_rows(model, Topology()))
    for tp in dst:
        check_loaded(model, Topology(tp=tp), shared)


@pytest.mark.parametrize("form", ["split-nhd", "packed-hnd"])
def test_gqa_replicated_heads_store_once(form):
    # 2 KV heads over TP=4: ranks (0, 1) and (2, 3) hold identical heads and take turns.
    model = Model(form, total_heads=2)
    shared, written = store(model, Topology(tp=4), reference(model, Topology(tp=4)), BLOCKS, CHUNKS)
    np.testing.assert_array_equal(stored_rows(shared), expected_rows(model, Topology()))
    assert written == expected_rows(model, Topology()).size  # each byte written once
    for tp in (1, 2, 4):
        check_loaded(model, Topology(tp=tp), shared)


def test_mla_one_copy_writers_rotate():
    model = Model("mla", total_heads=1, head_size=16)
    shared, written = store(model, Topology(tp=4), reference(model, Topology(tp=4)), BLOCKS, CHUNKS)
    np.testing.assert_array_equal(stored_rows(shared), expected_rows(model, Topology()))
    assert written == expected_rows(model, Topology()).size
    check_loaded(model, Topology(tp=1), shared)
    check_loaded(model, Topology(tp=2), shared)


@pytest.mark.parametrize("form", ["split-nhd", "packed-hnd", "mla"])
@pytest.mark.parametrize("interleave", [1, 2])
def test_dcp_round_trip(form, interleave):
    # DCP 2: each rank holds 4 of a canonical block's 8 tokens, interleaved.
    heads = 1 if form == "mla" else 2
    model = Model(form, total_heads=heads, block_size=4)
    topo = Topology(tp=4, dcp=2, interleave=interleave)
    shared, _ = store(model, topo, reference(model, topo), BLOCKS, CHUNKS)
    single = dataclasses.replace(model, block_size=8)
    np.testing.assert_array_equal(stored_rows(shared), expected_rows(single, Topology()))
    check_loaded(single, Topology(tp=1), shared)  # one device, 8-token blocks
    check_loaded(model, Topology(tp=4, dcp=2, interleave=3 - interleave), shared)
    check_loaded(model, Topology(tp=2, pcp=2, interleave=3 - interleave), shared)
