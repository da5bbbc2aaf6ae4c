"""derive over a whole KV cache config (vLLM cases C17-C20) and fail-closed registration."""

from __future__ import annotations

import pytest

from jax_kvoffload.config import (
    CanonicalLayoutError,
    HiSparseHotSpec,
    KVQuantMode,
    MambaSpec,
    UniformTypeKVCacheSpecs,
    register_canonical_layout,
)
from jax_kvoffload.config.canonical import (
    canonical_format_id,
    derive_canonical_mappings,
    derive_layer_mappings,
)
from tests.config.harness import build, engine, group, kv_config

from .helpers import NUM_BLOCKS, form, fs, ms, triples


def mixed_model():
    return kv_config(
        group(fs(1), "attn"),
        group(ms(), "mla"),
        group(fs(1, kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD), "quant"),
        num_blocks=NUM_BLOCKS,
    )


def test_c17_mixed_model_tp4_dcp2():
    eng = engine(tp=4, dcp=2, total_kv_heads=2, block_size=4, rank=2)
    views = {"attn": form("split-nhd", 1), "quant": form("split-nhd", 1)}
    got = derive_canonical_mappings(eng, mixed_model(), views)
    assert set(got) == {"attn", "mla", "quant"}
    assert not got["attn"].parallelism_agnostic and got["attn"].runs
    quant = got["quant"]
    assert not quant.parallelism_agnostic
    assert quant.canonical_page_size_bytes == 4 * fs(1).real_page_size_bytes
    assert triples(quant) == [(0, 2 * 512, 512)]
    layers = derive_layer_mappings(eng, mixed_model(), views)
    assert layers["attn"].certified and layers["mla"].certified
    assert "per-token-head" in layers["quant"].refusal


def test_c18_pipeline_parallel_gives_nothing():
    eng = engine(tp=2, pp=2, total_kv_heads=4, block_size=4)
    assert derive_canonical_mappings(eng, mixed_model(), {}) == {}


def test_c19_mamba_uniform_mla_and_bare_spec():
    mamba = MambaSpec(block_size=4, shapes=((8,),), dtypes=("float32",), page_size_padded=64)
    uniform = UniformTypeKVCacheSpecs(block_size=4, kv_cache_specs={"m0": ms(64), "m1": ms(32)})
    kv = kv_config(
        group(mamba, "mamba"),
        group(uniform, "m0", "m1"),
        group(HiSparseHotSpec(block_size=4, page_size=16), "bare"),
        num_blocks=NUM_BLOCKS,
    )
    got = derive_canonical_mappings(engine(tp=2, total_kv_heads=2, rank=1, block_size=4), kv, {})
    assert set(got) == {"mamba", "m0", "m1"}
    assert got["mamba"].canonical_page_size_bytes == 64
    assert triples(got["mamba"]) == [(0, 32, 32)]
    assert got["m0"].canonical_page_size_bytes == 256
    assert got["m1"].canonical_page_size_bytes == 128
    assert got["m1"].writer_index == 1


def test_c20_canonical_format_id():
    assert canonical_format_id("LBNHC") == "v1-nhd"
    assert canonical_format_id("LBHNC") == "v1-hnd"
    assert canonical_format_id("BLHNC") == "v1-blhnc"
    with pytest.raises(KeyError):
        canonical_format_id("NHD")


def _register(kv, views, *, extra=True, **eng_kw):
    eng_kw.setdefault("block_size", 4)
    config = build(kv, {"canonical_layout": True} if extra else {}, **eng_kw)
    return config, register_canonical_layout(config, engine(**eng_kw), kv, views)


def test_registration_certifies_and_reports_portability():
    kv = kv_config(group(fs(2), "a", "b"), num_blocks=NUM_BLOCKS)
    views = {"a": form("packed-nhd", 2), "b": form("split-hnd", 2)}
    config, reg = _register(kv, views, tp=2, total_kv_heads=4, rank=1)
    assert config.parallel.is_parallelism_agnostic and reg.all_layers_portable
    assert reg.mapping("b").canonical_page_size_bytes == 2 * fs(2).real_page_size_bytes


def test_registration_refuses_an_uncertifiable_layer_naming_it():
    kv = kv_config(group(fs(2), "good", "bad"), num_blocks=NUM_BLOCKS)
    views = {"good": form("split-nhd", 2), "bad": [form("split-nhd", 2)] * 2}
    with pytest.raises(CanonicalLayoutError) as info:
        _register(kv, views, tp=2, total_kv_heads=4)
    err = info.value
    assert isinstance(err, ValueError) and err.layer == "bad"
    assert "several tensors" in err.reason
    assert "'bad'" in str(err) and "remove canonical_layout" in str(err)


def test_registration_refuses_quantised_layer():
    q = fs(2, kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD)
    kv = kv_config(group(q, "q"), num_blocks=NUM_BLOCKS)
    with pytest.raises(CanonicalLayoutError, match=r"'q'.*per-token-head"):
        _register(kv, {"q": form("split-nhd", 2)}, tp=2, total_kv_heads=4)


def test_registration_refuses_pipeline_parallel_workers():
    kv = kv_config(group(fs(2), "a"), num_blocks=NUM_BLOCKS)
    with pytest.raises(CanonicalLayoutError, match="exactly the TP x PCP group"):
        _register(kv, {"a": form("split-nhd", 2)}, tp=2, pp=2, total_kv_heads=4)


def test_registration_without_the_flag_keeps_opaque_pages():
    kv = kv_config(group(fs(2), "bad"), num_blocks=NUM_BLOCKS)
    _, reg = _register(kv, {"bad": None}, extra=False, tp=2, total_kv_heads=4)
    assert not reg.layers["bad"].certified and not reg.all_layers_portable
    assert triples(reg.mapping("bad")) == [(0, 0, 1024)]


def test_claimed_agnosticism_with_unportable_layers_raises():
    # The static gate cannot see a DCP layout's runtime mapping; a config that claims
    # agnosticism (here: built for dcp=1) registered on dcp=2 workers must be refused.
    kv = kv_config(group(ms(), "a"), num_blocks=NUM_BLOCKS)
    config = build(kv, {"canonical_layout": True}, tp=2, total_kv_heads=1, block_size=4)
    assert config.parallel.is_parallelism_agnostic
    eng = engine(tp=2, dcp=2, total_kv_heads=1, block_size=4)
    with pytest.raises(CanonicalLayoutError, match=r"claims is_parallelism_agnostic.*'a'") as info:
        register_canonical_layout(config, eng, kv, {})
    assert info.value.layer == "a"
    # The same workers without the claim are certified (not portable, but stored).
    reg = register_canonical_layout(
        build(kv, {}, tp=2, total_kv_heads=1, block_size=4), eng, kv, {}
    )
    assert reg.layers["a"].certified and not reg.all_layers_portable
