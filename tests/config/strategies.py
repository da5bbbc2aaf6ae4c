"""Hypothesis strategies for random engine and KV cache descriptions."""

from __future__ import annotations

from hypothesis import strategies as st

from jax_kvoffload.config import (
    CacheConfig,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    EngineConfig,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVEventsConfig,
    KVQuantMode,
    KVTransferConfig,
    MambaSpec,
    MLAAttentionSpec,
    ModelConfig,
    ParallelConfig,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

block_sizes = st.sampled_from([1, 4, 8, 12, 16, 24, 32, 64])
dtypes = st.sampled_from(["float16", "bfloat16", "float32", "float8_e4m3fn", "uint8"])
heads = st.sampled_from([1, 2, 4, 8])


def _block_size(draw, bs):
    # Mostly the scenario's block size, so that translations often succeed.
    if bs is not None and draw(st.integers(0, 3)) > 0:
        return bs
    return draw(block_sizes)


@st.composite
def attention_specs(draw, bs=None):
    bs = _block_size(draw, bs)
    common = {
        "block_size": bs,
        "num_kv_heads": draw(heads),
        "head_size": draw(st.sampled_from([64, 128])),
        "dtype": draw(dtypes),
        "kv_quant_mode": draw(
            st.sampled_from([KVQuantMode.NONE, KVQuantMode.NONE, KVQuantMode.INT8_PER_TOKEN_HEAD])
        ),
    }
    kind = draw(
        st.sampled_from(["full", "full", "swa", "chunked", "full", "swa", "chunked", "ring"])
    )
    if kind == "full":
        return FullAttentionSpec(**common)
    if kind == "swa":
        return SlidingWindowSpec(
            **common,
            sliding_window=draw(st.integers(1, 512)),
            extra_retained_tokens=draw(st.integers(0, 8)),
        )
    if kind == "chunked":
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=draw(st.integers(1, 512)))
    return CircularBufferSpec(**common)


@st.composite
def mla_specs(draw, bs=None):
    bs = _block_size(draw, bs)
    return MLAAttentionSpec(
        block_size=bs,
        head_size=draw(st.sampled_from([128, 512, 576])),
        dtype=draw(dtypes),
        tokens_per_state=draw(st.sampled_from([1, 1, 2, 4])),
    )


@st.composite
def mamba_specs(draw, bs=None):
    bs = _block_size(draw, bs)
    return MambaSpec(
        block_size=bs,
        shapes=((draw(st.integers(1, 8)), 4),),
        dtypes=(draw(dtypes),),
        mamba_cache_mode=draw(st.sampled_from(["none", "align"])),
    )


@st.composite
def group_specs(draw, bs=None):
    base = st.one_of(attention_specs(bs), mla_specs(bs), mamba_specs(bs))
    if draw(st.integers(0, 5)) == 0:
        bs = _block_size(draw, bs)
        inner = draw(
            st.lists(st.one_of(mla_specs(bs), attention_specs(bs)), min_size=1, max_size=3)
        )
        specs = {f"u{i}": s for i, s in enumerate(inner)}
        return UniformTypeKVCacheSpecs(block_size=bs, kv_cache_specs=specs)
    return draw(base)


@st.composite
def kv_cache_configs(draw, bs=None):
    min_groups = 0 if draw(st.integers(0, 9)) == 0 else 1
    specs = draw(st.lists(group_specs(bs), min_size=min_groups, max_size=3))
    groups = []
    for i, spec in enumerate(specs):
        n_layers = len(spec.kv_cache_specs) if isinstance(spec, UniformTypeKVCacheSpecs) else 2
        groups.append(
            KVCacheGroupSpec(
                layer_names=tuple(f"g{i}.l{j}" for j in range(n_layers)),
                kv_cache_spec=spec,
                enable_kv_transfer=draw(st.integers(0, 7)) > 0,
                role=(
                    KVCacheGroupRole.HISPARSE_INDEXER
                    if draw(st.integers(0, 7)) == 0
                    else KVCacheGroupRole.DEFAULT
                ),
            )
        )
    num_blocks = draw(st.sampled_from([0, 1, 4, 100]))
    tensors = ()
    if groups and num_blocks and draw(st.booleans()):
        page = max(g.kv_cache_spec.page_size_bytes for g in groups)
        tensors = (
            KVCacheTensor(
                size=page * num_blocks * len(groups[0].layer_names),
                layers=groups[0].layer_names,
                layer_stride=page * num_blocks,
                block_stride=page,
            ),
        )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=tuple(groups),
        hisparse_host_num_blocks=draw(st.sampled_from([None] * 11 + [4])),
        kv_tp_replicas=draw(st.sampled_from([1, 2, 4])),
    )


chunk_values = st.one_of(
    st.none(), st.none(), st.integers(-2, 256), st.sampled_from(["64", "0", "x", 32.0])
)


@st.composite
def extra_configs(draw):
    extra = {}
    for key in ("block_size", "blocks_per_chunk"):
        value = draw(chunk_values)
        if key == "block_size" and isinstance(value, int) and draw(st.booleans()):
            value = value - value % 16  # often a multiple of common block sizes
        if value is not None or draw(st.booleans()):
            extra[key] = value
    if draw(st.booleans()):
        extra["canonical_layout"] = draw(st.sampled_from([True, False, "false", "", 0, 1]))
    return extra


def _valid_dcp(tp: int, pcp: int) -> list[int]:
    # vLLM's rule: DCP divides TP without PCP; with PCP it is 1, PCP or TP x PCP.
    if pcp == 1:
        return [1, 1, *(d for d in (2, 4) if tp % d == 0)]
    return [1, pcp, tp * pcp]


@st.composite
def engine_configs(draw, extra=None, bs=None):
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 1, 2]))
    pcp = draw(st.sampled_from([1, 1, 2]))
    world = tp * pp * pcp
    return EngineConfig(
        model_config=ModelConfig(
            model="random-model",
            dtype=draw(st.sampled_from(["float16", "bfloat16"])),
            total_num_kv_heads=draw(st.sampled_from([1, 2, 4, 8])),
            use_mla=draw(st.booleans()),
            max_model_len=draw(st.sampled_from([0, 4096])),
        ),
        cache_config=CacheConfig(
            block_size=bs if bs is not None else draw(block_sizes),
            cache_dtype=draw(st.sampled_from(["auto", "float16", "fp8_e4m3"])),
            enable_prefix_caching=draw(st.booleans()),
            prefix_match_unit=draw(st.sampled_from([None] * 6 + [1, 4, 16])),
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            prefill_context_parallel_size=pcp,
            decode_context_parallel_size=draw(st.sampled_from(_valid_dcp(tp, pcp))),
            rank=draw(st.integers(0, world - 1)),
            distributed_executor_backend=draw(st.sampled_from([None, "mp", "uni", "ray"])),
            nnodes_within_dp=draw(st.sampled_from([1, 1, 2])),
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector_extra_config=extra if extra is not None else draw(extra_configs()),
            engine_id="engine-h",
        ),
        kv_events_config=draw(st.sampled_from([None, KVEventsConfig(enable_kv_cache_events=True)])),
        use_v2_model_runner=draw(st.booleans()),
    )


@st.composite
def scenarios(draw):
    """An (engine, kv cache) pair sharing a block size most of the time."""
    bs = draw(block_sizes)
    return draw(engine_configs(bs=bs)), draw(kv_cache_configs(bs=bs))
