"""vLLM 0.33.0's verified canonical-mapping examples (vLLM's
tests/v1/kv_connector/unit/offloading_connector/test_canonical_mapping.py;
numbered C1-C16, C21 here),
reproduced exactly: runs, canonical sizes, writers and tiling."""

from __future__ import annotations

import numpy as np
import pytest

from jax_kvoffload.config import KVQuantMode
from jax_kvoffload.config.canonical import (
    CanonicalTilingError,
    CopyRun,
    KVTensorView,
    coalesce_runs,
    layer_mapping,
    layer_mapping_or_reason,
    opaque_fallback_mapping,
    verify_tiling,
)

from .helpers import FORMS, NUM_BLOCKS, ctx, form, fs, ms, triples


def all_ranks(spec, view, tp, **kw):
    n = tp * kw.get("pcp", 1)
    out = [layer_mapping(spec, view, NUM_BLOCKS, ctx(r, tp, **kw)) for r in range(n)]
    assert all(m is not None for m in out)
    return out


def test_c1_split_nhd_tp4_rank2():
    m = layer_mapping(fs(2), form("split-nhd", 2), NUM_BLOCKS, ctx(2, 4))
    assert (m.canonical_page_size_bytes, m.parallelism_agnostic, m.num_writers) == (4096, True, 1)
    assert m.runs == (CopyRun(0, 256, 128, 4, 128, 512), CopyRun(512, 2304, 128, 4, 128, 512))
    assert triples(m) == [
        (lo, c, 128)
        for lo, c in zip(range(0, 1024, 128), [256, 768, 1280, 1792, 2304, 2816, 3328, 3840])
    ]


def test_c2_packed_nhd_tp4_rank2():
    m = layer_mapping(fs(2), form("packed-nhd", 2), NUM_BLOCKS, ctx(2, 4))
    assert triples(m) == [(0, 512, 256), (256, 1536, 256), (512, 2560, 256), (768, 3584, 256)]


def test_c3_packed_hnd_tp4_rank1():
    m = layer_mapping(fs(2), form("packed-hnd", 2), NUM_BLOCKS, ctx(1, 4))
    assert triples(m) == [(0, 1024, 1024)]


@pytest.mark.parametrize("name", FORMS)
def test_c4_single_rank_is_one_whole_page_run(name):
    m = layer_mapping(fs(2), form(name, 2), NUM_BLOCKS, ctx(0, 1))
    assert m.canonical_page_size_bytes == 1024
    assert triples(m) == [(0, 0, 1024)]


def test_c5_gqa_replicated_heads_rotate_writers():
    spec, view = fs(1), form("split-nhd", 1)
    per_rank = all_ranks(spec, view, 4, total=2)
    m2, m3 = per_rank[2], per_rank[3]
    assert m2.canonical_page_size_bytes == 1024
    assert triples(m2)[:4] == [(0, 64, 64), (64, 192, 64), (128, 320, 64), (192, 448, 64)]
    assert m2.runs == m3.runs
    assert (m2.num_writers, m2.writer_index, m3.writer_index) == (2, 0, 1)
    assert m2.is_writer(0) and not m3.is_writer(0)
    assert m3.is_writer(1) and not m2.is_writer(1)
    verify_tiling("attn", per_rank)


def test_c6_mla_tp2_one_copy_alternating_writers():
    m0, m1 = all_ranks(ms(), None, 2)
    assert m0.canonical_page_size_bytes == 256
    assert triples(m0) == [(0, 0, 256)] and m0.runs == m1.runs
    assert [m0.is_writer(b) for b in range(4)] == [True, False, True, False]
    assert [m1.is_writer(b) for b in range(4)] == [False, True, False, True]


def test_c7_dcp2_gqa_split_nhd():
    per_rank = all_ranks(fs(1), form("split-nhd", 1), 4, dcp=2, total=2)
    m = per_rank[2]
    assert (m.canonical_page_size_bytes, m.parallelism_agnostic) == (2048, False)
    assert triples(m)[:4] == [(0, 64, 64), (64, 320, 64), (128, 576, 64), (192, 832, 64)]
    assert all(x.num_writers == 1 for x in per_rank)
    verify_tiling("attn", per_rank)


def test_c8_mla_tp2_dcp2_interleave1():
    m0, m1 = all_ranks(ms(), None, 2, dcp=2)
    assert m0.canonical_page_size_bytes == 512
    assert triples(m0) == [(o, 2 * o, 64) for o in (0, 64, 128, 192)]
    assert triples(m1) == [(o, 2 * o + 64, 64) for o in (0, 64, 128, 192)]
    verify_tiling("mla", [m0, m1])


def test_c9_pcp2_packed_nhd_four_ranks_tile():
    per_rank = all_ranks(fs(1), form("packed-nhd", 1), 2, pcp=2, total=2)
    assert len(per_rank) == 4 and all(m.runs for m in per_rank)
    verify_tiling("attn", per_rank)


def test_c10_mla_dcp2_interleave2():
    m0, m1 = all_ranks(ms(), None, 2, dcp=2, interleave=2)
    assert triples(m0) == [(0, 0, 128), (128, 256, 128)]
    verify_tiling("mla", [m0, m1])


@pytest.mark.parametrize("name", FORMS)
def test_c11_every_form_tp4_tiles(name):
    verify_tiling("attn", all_ranks(fs(2), form(name, 2), 4))


def _round_trip(spec, name, tp, total, reference, **kw):
    """Each rank loads its page from the reference; the writers' stores rebuild it."""
    view = form(name, spec.num_kv_heads) if name else None
    per_rank = all_ranks(spec, view, tp, total=total, **kw)
    for block in range(per_rank[0].num_writers):
        rebuilt = np.zeros_like(reference)
        for m in per_rank:
            local = np.zeros(m.local_page_size_bytes, np.uint8)
            for lo, c, n in triples(m):
                local[lo : lo + n] = reference[c : c + n]
            if m.is_writer(block):
                for lo, c, n in triples(m):
                    rebuilt[c : c + n] = local[lo : lo + n]
        np.testing.assert_array_equal(rebuilt, reference)


@pytest.mark.parametrize("name", FORMS)
@pytest.mark.parametrize("tp", [4, 2, 1])
def test_c12_cross_tp_round_trip(name, tp):
    reference = ((7 + 31 * np.arange(4096)) % 256).astype(np.uint8)
    spec = fs(8 // tp)
    m = layer_mapping(spec, form(name, 8 // tp), NUM_BLOCKS, ctx(0, tp, total=8))
    assert m.canonical_page_size_bytes == 4096
    _round_trip(spec, name, tp, 8, reference)


def test_c13_cp_round_trip():
    reference = ((3 + 17 * np.arange(2048)) % 256).astype(np.uint8)
    _round_trip(fs(1), "split-nhd", 4, 2, reference, dcp=2)


def test_c14_replica_rotation_mla():
    reference = ((5 + 11 * np.arange(256)) % 256).astype(np.uint8)
    _round_trip(ms(), None, 2, 2, reference)


def test_c15_refusals():
    refused = [
        (fs(2), form("split-nhd", 2), ctx(0, 4, total=2)),  # heads != H/T
        (fs(1), form("split-nhd", 1), ctx(0, 3, total=2)),  # T % H != 0
        (fs(2), form("split-nhd", 2), ctx(0, 4, dcp=2)),  # replication 1 with dcp 2
        (fs(1), form("split-nhd", 1), ctx(0, 2, dcp=2, interleave=3, total=2)),
        (fs(1), form("split-nhd", 1), ctx(0, 2, dcp=2, interleave=8, total=2)),
        (fs(2, kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD), form("split-nhd", 2), ctx(0, 1)),
        (ms(tokens_per_state=2), None, ctx(0, 2, dcp=2)),
        (ms(kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD), None, ctx(0, 2)),
        (ms(), None, ctx(0, 3, dcp=2)),  # tp % dcp != 0
        (ms(), None, ctx(0, 2, dcp=2, interleave=8)),  # interleave > block with cp > 1
        (fs(2), None, ctx(0, 1)),  # no tensor
        (fs(2), [form("split-nhd", 2)] * 2, ctx(0, 1)),  # several tensors
    ]
    # A contiguous (3, 4, 2, h, 64) tensor seen as (3, 2, 4, h, 64): K/V not page halves.
    permuted = KVTensorView((NUM_BLOCKS, 2, 4, 2, 64), (1024, 128, 256, 64, 1), 1)
    refused.append((fs(2), permuted, ctx(0, 1)))
    for spec, view, c in refused:
        assert layer_mapping(spec, view, NUM_BLOCKS, c) is None, (spec, view, c)
        assert isinstance(layer_mapping_or_reason(spec, view, NUM_BLOCKS, c), str)


def test_c15_interleave_ignored_without_cp():
    assert layer_mapping(fs(2), form("split-nhd", 2), NUM_BLOCKS, ctx(0, 1, interleave=3))


def test_refusal_reasons_name_the_rule():
    reason = layer_mapping_or_reason(fs(2), form("split-nhd", 2), NUM_BLOCKS, ctx(0, 4, total=2))
    assert "num_kv_heads=2" in reason and "total KV heads 2" in reason
    reason = layer_mapping_or_reason(
        fs(2), KVTensorView((3, 4, 2, 2, 64), (1024, 256, 128, 64, 1), 1), NUM_BLOCKS, ctx(0, 1)
    )
    assert "neither packed" in reason


def test_c16_opaque_fallback():
    per_rank = [opaque_fallback_mapping(1024, 4, r) for r in range(4)]
    m = per_rank[2]
    assert (m.canonical_page_size_bytes, m.parallelism_agnostic, m.num_writers) == (4096, False, 1)
    assert triples(m) == [(0, 2048, 1024)]
    verify_tiling("opaque", per_rank)


def test_c21_coalesce():
    runs = [
        CopyRun(0, 0, 10, 1, 10, 10),
        CopyRun(10, 10, 5, 1, 5, 5),
        CopyRun(20, 40, 4, 3, 4, 4),
        CopyRun(32, 52, 2, 1, 2, 2),
    ]
    assert coalesce_runs(runs) == (CopyRun(0, 0, 15, 1, 15, 15), CopyRun(20, 40, 14, 1, 14, 14))


def test_tiling_errors_name_the_layer():
    good = layer_mapping(fs(2), form("split-nhd", 2), NUM_BLOCKS, ctx(0, 2))
    with pytest.raises(CanonicalTilingError, match=r"'layer.7'.*do not tile"):
        verify_tiling("layer.7", [good, good])  # two ranks writing the same half
    short = opaque_fallback_mapping(1024, 1, 0)
    gap = type(short)(2048, 1024, (*short.runs[:1], CopyRun(0, 1024, 512, 1, 512, 512)))
    with pytest.raises(CanonicalTilingError, match=r"'l'.*cover the local page"):
        verify_tiling("l", [gap])
    with pytest.raises(CanonicalTilingError, match="rank 1 has canonical page"):
        verify_tiling("l", [short, opaque_fallback_mapping(1024, 2, 1)])
