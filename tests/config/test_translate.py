"""vLLM's build_offloading_config cases (vLLM's
tests/v1/kv_connector/unit/offloading_connector/test_config.py and
test_build_offloading_config.py), one test each.

Every expectation here is what vLLM 0.33.0 produces (each case was run against it).
"""

from __future__ import annotations

import pytest

from jax_kvoffload.config import (
    ChunkedLocalAttentionSpec,
    ChunkMultipleError,
    ChunkSizeError,
    KVCacheGroupRole,
    KVCacheTensor,
    KVEventsConfig,
    KVQuantMode,
    MissingTransferConfigError,
    NoEligibleGroupsError,
    NonUniformBlockSizeError,
    OffloadConfigError,
    SlidingWindowSpec,
    TokensPerHashError,
    UniformTypeKVCacheSpecs,
    WindowSpecError,
)

from .harness import build, full, group, kv_config, mamba, mla, ring


def swa(window: int, retained: int = 0, bs: int = 16, heads: int = 4):
    return SlidingWindowSpec(
        block_size=bs,
        num_kv_heads=heads,
        head_size=128,
        dtype="float16",
        sliding_window=window,
        extra_retained_tokens=retained,
    )


def test_a1_bytes_per_block_come_from_the_tensor_not_the_spec():
    spec = full(16, 1, 1, "float32")  # its own page would be 128 B
    one = KVCacheTensor(size=64, layers=("l0", "l1"), layer_stride=32, block_stride=8)
    two = (
        KVCacheTensor(size=64, layers=("l0",), layer_stride=0, block_stride=8),
        KVCacheTensor(size=64, layers=("l1",), layer_stride=0, block_stride=8, offset=32),
    )
    for tensors in ((one,), two):
        kv = kv_config(group(spec, "l0", "l1"), num_blocks=4, tensors=tensors)
        cfg = build(kv, {"block_size": 32}, tp=3, pp=2)
        assert cfg.worker_kv_bytes_per_block == 16
        assert cfg.parallel.world_size == 6
        assert cfg.cache.blocks_per_chunk == 2


def test_a2_without_tensors_bytes_are_summed_over_groups():
    kv = kv_config(group(full(16, 1, 1, "float32"), "l0", "l1"), num_blocks=4)
    assert build(kv).worker_kv_bytes_per_block == 256


def test_a3_zero_blocks_give_zero_bytes():
    kv = kv_config(group(full(), "l0", "l1"), num_blocks=0)
    assert build(kv).worker_kv_bytes_per_block == 0


def test_a4_hisparse_selects_the_indexer_group_and_skips_the_tensor_branch():
    kv = kv_config(
        group(full(), "source", host_resident=True),
        group(full(), "indexer", role=KVCacheGroupRole.HISPARSE_INDEXER),
        num_blocks=4,
        tensors=[KVCacheTensor(size=10**6, layers=("source",), layer_stride=0, block_stride=1)],
        hisparse_host_num_blocks=4,
    )
    cfg = build(kv)
    assert [(g.group_id, g.layer_names) for g in cfg.groups] == [(1, ("indexer",))]
    assert cfg.worker_kv_bytes_per_block == full().page_size_bytes == 32768


def test_a5_hisparse_bytes_are_the_same_for_a_wrapper_and_a_flat_spec():
    wrapper = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": full(), "b": full()})
    results = []
    for spec in (wrapper, full()):
        kv = kv_config(
            group(full(), "source", host_resident=True),
            group(spec, "a", "b", role=KVCacheGroupRole.HISPARSE_INDEXER),
            num_blocks=4,
            hisparse_host_num_blocks=4,
        )
        results.append(build(kv).worker_kv_bytes_per_block)
    assert results == [2 * full().page_size_bytes] * 2


def test_a6_pcp_does_not_scale_block_size():
    cfg = build(kv_config(group(full(16))), {"block_size": 64}, pcp=2)
    assert [g.tokens_per_block for g in cfg.groups] == [16]
    assert cfg.cache.tokens_per_hash == 16
    assert cfg.cache.blocks_per_chunk == 4


def test_a7_dcp_scales_attention_but_not_mamba():
    kv = kv_config(group(full(16), "attn"), group(mamba(16, "align"), "ssm"))
    cfg = build(kv, tp=2, dcp=2)
    assert [g.tokens_per_block for g in cfg.groups] == [32, 16]
    assert cfg.cache.tokens_per_hash == 16
    assert [g.sliding_window_size_in_chunks for g in cfg.groups] == [None, 1]


@pytest.mark.parametrize(("dcp", "expected"), [(1, 16), (2, 32)])
def test_a8_dcp_scales_a_uniform_mla_wrapper(dcp, expected):
    wrapper = UniformTypeKVCacheSpecs(
        block_size=16, kv_cache_specs={"a": mla(16, 512), "b": mla(16, 128)}
    )
    cfg = build(kv_config(group(wrapper, "a", "b")), tp=2, dcp=dcp)
    assert cfg.groups[0].tokens_per_block == expected
    assert cfg.cache.tokens_per_hash == expected


def test_a9_data_parallel_fields_are_copied():
    cfg = build(
        kv_config(group(full())),
        data_parallel_index=2,
        data_parallel_size=4,
        data_parallel_rank_local=1,
    )
    p = cfg.parallel
    assert (p.data_parallel_index, p.data_parallel_size, p.data_parallel_rank_local) == (2, 4, 1)


def test_a10_heterogeneous_block_sizes():
    kv = kv_config(group(full(12, 4, 128), "attn"), group(mla(16, 512), "mla"))
    cfg = build(kv, block_size=4)
    assert [g.tokens_per_block for g in cfg.groups] == [12, 16]
    assert (cfg.cache.tokens_per_hash, cfg.cache.blocks_per_chunk) == (4, 1)
    assert build(kv, {"blocks_per_chunk": 2}, block_size=4).cache.blocks_per_chunk == 2
    with pytest.raises(NonUniformBlockSizeError, match="same block size") as err:
        build(kv, {"block_size": 48}, block_size=4)
    assert err.value.tokens_per_block == (12, 16)


def test_a11_block_size_and_blocks_per_chunk_are_exclusive():
    with pytest.raises(ChunkSizeError, match="Specify only one"):
        build(kv_config(group(full())), {"block_size": 64, "blocks_per_chunk": 2})


@pytest.mark.parametrize("value", [0, -1, "0"])
def test_a12_blocks_per_chunk_must_be_positive(value):
    with pytest.raises(ChunkSizeError, match="greater than 0"):
        build(kv_config(group(full())), {"blocks_per_chunk": value})


def test_a12_blocks_per_chunk_strings_are_parsed():
    assert build(kv_config(group(full())), {"blocks_per_chunk": "3"}).cache.blocks_per_chunk == 3


@pytest.mark.parametrize(("tokens", "suggested"), [(40, 48), (8, 16)])
def test_a13_block_size_must_be_a_multiple_and_the_fix_is_suggested(tokens, suggested):
    with pytest.raises(ChunkMultipleError) as err:
        build(kv_config(group(full())), {"block_size": tokens})
    message = str(err.value)
    assert f"'block_size'={tokens}" in message
    assert "multiple of the GPU KV cache block size (16 tokens)" in message
    assert f"Use {suggested} instead" in message
    assert err.value.suggested == suggested


def test_a13_block_size_string_and_zero_quirk():
    assert build(kv_config(group(full())), {"block_size": "64"}).cache.blocks_per_chunk == 4
    # vLLM quirk: no positivity check on this path.
    assert build(kv_config(group(full())), {"block_size": 0}).cache.blocks_per_chunk == 0


def test_a_negative_block_size_is_refused_where_vllm_returns_a_negative_chunk():
    with pytest.raises(ChunkSizeError, match=r"'block_size' must be >= 0.*-2 blocks per chunk"):
        build(kv_config(group(full())), {"block_size": -32})


def test_non_numeric_chunk_values_raise_a_typed_error():
    with pytest.raises(ChunkSizeError, match="not an integer"):
        build(kv_config(group(full())), {"block_size": "sixty"})


def test_a14_only_ring_buffers_means_no_eligible_groups():
    with pytest.raises(NoEligibleGroupsError, match="no eligible cache groups"):
        build(kv_config(group(ring(4), "r0"), group(ring(8), "r1")))


def test_a15_ring_buffer_groups_are_dropped():
    cfg = build(kv_config(group(full(1152), "attn"), group(ring(4), "ring")))
    assert [(g.group_id, g.tokens_per_block) for g in cfg.groups] == [(0, 1152)]
    assert cfg.cache.tokens_per_hash == 1152


def test_a16_non_align_mamba_backs_off_to_the_lcm_and_fails_divisibility():
    kv = kv_config(group(full(16), "attn"), group(mamba(24, "none"), "ssm"))
    with pytest.raises(TokensPerHashError, match="not divisible") as err:
        build(kv)
    assert (err.value.tokens_per_block, err.value.tokens_per_hash) == (16, 48)
    assert "--enable-prefix-caching" in str(err.value)


def test_divisibility_is_checked_before_the_chunk_options():
    kv = kv_config(group(full(16), "attn"), group(mamba(24, "none"), "ssm"))
    with pytest.raises(TokensPerHashError):
        build(kv, {"block_size": 64, "blocks_per_chunk": 2})


def test_single_group_smaller_than_the_cache_block_fails_divisibility():
    # The single-group hash size is cache_config.block_size, not the spec's.
    with pytest.raises(TokensPerHashError):
        build(kv_config(group(full(8))), block_size=16)


def test_a18_groups_without_kv_transfer_are_not_selected():
    kv = kv_config(group(full(), "a"), group(full(), "b", enable_kv_transfer=False))
    assert [g.group_id for g in build(kv).groups] == [0]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (full(16), None),
        (swa(128), 4),
        (swa(128, retained=3), 5),
        (
            ChunkedLocalAttentionSpec(
                block_size=16,
                num_kv_heads=4,
                head_size=128,
                dtype="float16",
                attention_chunk_size=100,
            ),
            4,
        ),
        (mla(16), None),
    ],
)
def test_a19_window_sizes_in_chunks(spec, expected):
    cfg = build(kv_config(group(spec)), {"blocks_per_chunk": 2})
    assert cfg.groups[0].sliding_window_size_in_chunks == expected


def test_a19_window_uses_the_first_layer_of_a_wrapper():
    wrapper = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": swa(64), "b": swa(128)})
    cfg = build(kv_config(group(wrapper, "a", "b")), {"blocks_per_chunk": 1})
    assert cfg.groups[0].sliding_window_size_in_chunks == 4


def test_window_groups_with_zero_chunk_tokens_raise_instead_of_dividing_by_zero():
    with pytest.raises(ChunkSizeError, match="positive chunk size"):
        build(kv_config(group(swa(128))), {"block_size": 0})


def test_selected_groups_without_a_window_rule_are_refused():
    from jax_kvoffload.config import CrossAttentionSpec

    cross = CrossAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype="float16")
    with pytest.raises(WindowSpecError, match="CrossAttentionSpec"):
        build(kv_config(group(cross)))


def test_a20_dtype_layout_and_defaults():
    kv = kv_config(group(full()))
    assert build(kv, cache_dtype="float16").model.dtype == "float16"
    assert build(kv, cache_dtype="auto", model_dtype="bfloat16").model.dtype == "bfloat16"
    assert build(kv, cache_dtype="fp8_e4m3").model.dtype == "fp8_e4m3"
    cfg = build(kv, kv_cache_layout="LBHNC")
    assert cfg.kv_cache_layout == "LBHNC"
    assert cfg.canonical_layout is False
    assert cfg.enable_kv_cache_events is False
    # Copied through as given, as vLLM does (it never interprets the name here).
    assert build(kv, kv_cache_layout="HND").kv_cache_layout == "HND"


def test_a21_canonical_layout_is_read_by_truthiness():
    assert build(kv_config(group(full())), {"canonical_layout": "false"}).canonical_layout is True
    assert build(kv_config(group(full())), {"canonical_layout": 0}).canonical_layout is False


def test_events_and_identity_fields():
    cfg = build(kv_config(group(full())), events=KVEventsConfig(enable_kv_cache_events=True))
    assert cfg.enable_kv_cache_events is True
    assert cfg.engine_id == "engine-0"
    assert cfg.model.name == "test-model"
    assert cfg.extra_config == {}


def test_missing_transfer_config_is_a_typed_error():
    with pytest.raises(MissingTransferConfigError, match="kv_transfer_config"):
        build(kv_config(group(full())), transfer=False)


def test_every_error_is_a_value_error():
    for cls in (
        MissingTransferConfigError,
        NoEligibleGroupsError,
        TokensPerHashError,
        ChunkSizeError,
        WindowSpecError,
    ):
        assert issubclass(cls, OffloadConfigError)
        assert issubclass(cls, ValueError)


# --- replicated_layout (vLLM's test_config.py) ------------------------------------------------


def mla_kv(replicas: int = 1, num_blocks: int = 4, spec=None):
    spec = spec or mla(16, 512, "float32")
    layers = ("m0", "m1")
    tensor = KVCacheTensor(
        size=spec.page_size_bytes * 2 * num_blocks,
        layers=layers,
        layer_stride=spec.page_size_bytes * num_blocks,
        block_stride=spec.page_size_bytes,
    )
    return kv_config(
        group(spec, *layers),
        num_blocks=num_blocks,
        tensors=[tensor] if num_blocks else [],
        kv_tp_replicas=replicas,
    )


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("v2", [False, True])
def test_ar1_mla_replicated_over_tp(tp, v2):
    assert build(mla_kv(replicas=tp), use_mla=True, tp=tp, v2=v2).replicated_layout is True


@pytest.mark.parametrize("replicas", [1, 2])
def test_ar2_replicas_must_equal_tp(replicas):
    assert build(mla_kv(replicas=replicas), use_mla=True, tp=4).replicated_layout is False


@pytest.mark.parametrize(
    ("kv_kw", "engine_kw"),
    [
        ({"replicas": 1}, {"tp": 1}),
        ({"replicas": 2}, {"tp": 2, "use_mla": False}),
        ({"replicas": 2}, {"tp": 2, "pp": 2}),
        ({"replicas": 2}, {"tp": 2, "pcp": 2}),
        ({"replicas": 2}, {"tp": 2, "dcp": 2}),
        ({"replicas": 2}, {"tp": 2, "world_size": 8}),
        ({"replicas": 2}, {"tp": 2, "distributed_executor_backend": "ray"}),
        ({"replicas": 2}, {"tp": 2, "distributed_executor_backend": "uni"}),
        ({"replicas": 2}, {"tp": 2, "nnodes_within_dp": 2}),
        ({"replicas": 2, "num_blocks": 0}, {"tp": 2}),
    ],
)
def test_ar3_each_gate_turns_replication_off(kv_kw, engine_kw):
    engine_kw = {"use_mla": True, **engine_kw}
    assert build(mla_kv(**kv_kw), **engine_kw).replicated_layout is False


@pytest.mark.parametrize("kind", ["swa_mla", "full"])
def test_ar4_default_path_does_not_inspect_spec_types(kind):
    from jax_kvoffload.config import SlidingWindowMLASpec

    spec = (
        SlidingWindowMLASpec(block_size=16, head_size=576, dtype="float16", sliding_window=128)
        if kind == "swa_mla"
        else full()
    )
    assert build(mla_kv(replicas=2, spec=spec), use_mla=True, tp=2).replicated_layout is True


@pytest.mark.parametrize(
    ("spec_kind", "engine_kw", "expected"),
    [
        ("mla", {"tp": 2}, True),
        ("mla", {"tp": 1, "distributed_executor_backend": "uni"}, True),
        ("mla", {"tp": 2, "distributed_executor_backend": "ray"}, False),
        ("mla", {"tp": 2, "nnodes_within_dp": 2}, False),
        ("full", {"tp": 2}, False),
        ("mla", {"tp": 2, "use_mla": False}, True),
    ],
)
def test_ar5_canonical_path_recomputes_replication_from_spec_types(spec_kind, engine_kw, expected):
    spec = mla() if spec_kind == "mla" else full()
    engine_kw = {"use_mla": True, **engine_kw}
    cfg = build(kv_config(group(spec)), {"canonical_layout": True}, **engine_kw)
    assert cfg.replicated_layout is expected


# --- is_parallelism_agnostic (vLLM's test_config.py) ------------------------------------------


def agnostic(*groups, canonical: bool = False, **engine_kw) -> bool:
    extra = {"canonical_layout": True} if canonical else {}
    return build(kv_config(*groups), extra, **engine_kw).parallel.is_parallelism_agnostic


def test_ap1_default_path():
    assert agnostic(group(full(16, 4, 128))) is True
    assert agnostic(group(full(16, 4, 128)), v2=True) is False
    assert agnostic(group(full(16, 4, 128)), total_kv_heads=8) is False
    assert agnostic(group(full(16, 2)), tp=2) is True
    assert agnostic(group(full(16, 1)), tp=4, total_kv_heads=2) is False
    per_token_head = full(16, 4, kv_quant_mode=KVQuantMode.INT8_PER_TOKEN_HEAD)
    assert agnostic(group(per_token_head)) is False


def test_ap2_excluded_by_default():
    assert agnostic(group(mla(16, 576))) is False
    assert agnostic(group(swa(128))) is False
    assert agnostic(group(full(), "a"), group(full(), "b")) is False


def test_ap3_canonical_gate():
    from jax_kvoffload.config import HiddenStateCacheSpec, SlidingWindowMLASpec

    def uniform(*specs):
        names = [f"l{i}" for i in range(len(specs))]
        return group(
            UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=dict(zip(names, specs))), *names
        )

    chunked = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=128, dtype="float16", attention_chunk_size=64
    )
    swa_mla = SlidingWindowMLASpec(block_size=16, head_size=576, dtype="float16", sliding_window=64)
    hidden = HiddenStateCacheSpec(block_size=16, head_size=576, dtype="float16")
    cases = [
        ([group(mla(16, 576))], True),
        ([group(full(), "a"), group(swa(128), "b")], True),
        ([group(swa_mla)], False),
        ([group(full(), "a"), group(mamba(16, "align"), "b")], False),
        ([uniform(mla(16, 576), mla(16, 128))], True),
        ([uniform(mla(16, 576), mla(16, 576, tps=2))], False),
        ([group(hidden)], False),
        ([group(chunked)], False),
    ]
    for groups, expected in cases:
        assert agnostic(*groups) is False, groups
        assert agnostic(*groups, canonical=True) is expected, groups


def test_ap4_canonical_ignores_the_v2_runner():
    assert agnostic(group(full()), canonical=True, v2=True) is True


def test_ap5_canonical_gqa():
    assert agnostic(group(full(16, 1)), canonical=True, tp=4, total_kv_heads=2) is True
    assert agnostic(group(full(16, 2)), canonical=True, tp=4, total_kv_heads=2) is False
    assert agnostic(group(full(16, 1)), canonical=True, tp=3, total_kv_heads=2) is False


def test_ap6_context_and_pipeline_parallelism():
    assert agnostic(group(full(16, 2)), canonical=True, tp=2, dcp=2) is False
    assert agnostic(group(full()), pp=2) is True  # the default path ignores PP
    assert agnostic(group(swa(128)), canonical=True, pp=2) is False  # world != TP
    assert agnostic(group(swa(128)), canonical=True) is True
    assert agnostic(group(full()), canonical=True, pcp=2) is False
