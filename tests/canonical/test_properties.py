"""Property: every certifiable random configuration tiles exactly and round-trips through
the precomputed relayout (`CanonicalGroupPlan`) bit for bit, for every rank."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_kvoffload.config import FullAttentionSpec, MLAAttentionSpec
from jax_kvoffload.config.canonical import KVTensorView, RankContext, layer_mapping, verify_tiling
from jax_kvoffload.transfer import plan_for_group


@st.composite
def configs(draw):
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    dcp = draw(st.sampled_from([d for d in (1, 2, 4) if tp % d == 0]))
    pcp = draw(st.sampled_from([1, 2]))
    bs = draw(st.sampled_from([2, 4, 8]))
    interleave = draw(st.sampled_from([i for i in (1, 2, 4) if bs % i == 0]))
    hs = draw(st.sampled_from([1, 2, 3]))
    itemsize = draw(st.sampled_from([1, 2, 4]))
    dtype = {1: "int8", 2: "bfloat16", 4: "float32"}[itemsize]
    form = draw(st.sampled_from(["mla", "split-nhd", "split-hnd", "packed-nhd", "packed-hnd"]))
    total = draw(st.sampled_from([1, 2, 4, 8]))
    heads = max(1, total // tp)
    if form == "mla":
        spec = MLAAttentionSpec(block_size=bs, head_size=hs, dtype=dtype)
        view = None
    else:
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=hs, dtype=dtype)
        kind, order = form.split("-")
        make = KVTensorView.split if kind == "split" else KVTensorView.packed
        view = make(5, heads, bs, hs, itemsize, order)
    contexts = [RankContext(tp, dcp, pcp, interleave, total, r) for r in range(tp * pcp)]
    return spec, view, contexts


@settings(max_examples=150, deadline=None)
@given(configs(), st.integers(0, 2**32 - 1))
def test_certified_configs_tile_and_round_trip(cfg, seed):
    spec, view, contexts = cfg
    per_rank = [layer_mapping(spec, view, 5, c) for c in contexts]
    if any(m is None for m in per_rank):
        return  # refused (e.g. heads do not divide): nothing to store
    verify_tiling("layer", per_rank)
    size = per_rank[0].canonical_page_size_bytes
    rng = np.random.default_rng(seed)
    reference = rng.integers(0, 256, size=(4, size), dtype=np.uint8)
    slots = np.array([3, 0, 2, 1])
    rebuilt = np.zeros_like(reference)
    for m in per_rank:
        plan = plan_for_group([m], [m.local_page_size_bytes])
        local = np.empty((4, m.local_page_size_bytes), np.uint8)
        plan.load(reference, slots, local)
        plan.store(rebuilt, slots, local)
    np.testing.assert_array_equal(rebuilt, reference)
