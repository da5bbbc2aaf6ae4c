"""The common harness of vLLM's offloading config tests, re-expressed with our classes.

A mock engine with cache block 16, prefix caching on, no prefix_match_unit, cache dtype
float16, model "test-model", use_mla False, 4 total KV heads, a parallel config with the
given sizes (world = TP x PP x PCP, backend "mp" when world > 1), no events, V1 runner,
and an OffloadingConnector transfer config with the given extra config.
"""

from __future__ import annotations

from typing import Any

from jax_kvoffload.config import (
    CacheConfig,
    CircularBufferSpec,
    EngineConfig,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    KVTransferConfig,
    MambaSpec,
    MLAAttentionSpec,
    ModelConfig,
    ParallelConfig,
    build_offloading_config,
)


def full(bs: int = 16, heads: int = 4, hs: int = 128, dtype: str = "float16", **kw: Any):
    return FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=hs, dtype=dtype, **kw)


def mla(bs: int = 16, hs: int = 576, dtype: str = "float16", tps: int = 1, **kw: Any):
    return MLAAttentionSpec(block_size=bs, head_size=hs, dtype=dtype, tokens_per_state=tps, **kw)


def mamba(bs: int = 16, mode: str = "none"):
    return MambaSpec(block_size=bs, shapes=((1, 1),), dtypes=("float32",), mamba_cache_mode=mode)


def ring(bs: int = 4):
    return CircularBufferSpec(block_size=bs, num_kv_heads=4, head_size=64, dtype="float16")


def group(spec, *names: str, **kw: Any) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(layer_names=names or ("l0",), kv_cache_spec=spec, **kw)


def kv_config(*groups, num_blocks: int = 0, tensors=(), **kw: Any) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=tuple(tensors), kv_cache_groups=groups, **kw
    )


def packed_tensor(layers: tuple[str, ...], page: int, num_blocks: int) -> KVCacheTensor:
    return KVCacheTensor(
        size=page * len(layers) * num_blocks,
        layers=layers,
        layer_stride=page * num_blocks,
        block_stride=page,
    )


def engine(
    extra: dict | None = None,
    *,
    tp: int = 1,
    pp: int = 1,
    pcp: int = 1,
    dcp: int = 1,
    block_size: int = 16,
    prefix_match_unit: int | None = None,
    enable_prefix_caching: bool = True,
    cache_dtype: Any = "float16",
    model_dtype: Any = "float16",
    use_mla: bool = False,
    total_kv_heads: int = 4,
    v2: bool = False,
    transfer: bool = True,
    events=None,
    kv_cache_layout: str | None = None,
    **parallel: Any,
) -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig(
            model="test-model",
            dtype=model_dtype,
            use_mla=use_mla,
            total_num_kv_heads=total_kv_heads,
        ),
        cache_config=CacheConfig(
            block_size=block_size,
            cache_dtype=cache_dtype,
            enable_prefix_caching=enable_prefix_caching,
            prefix_match_unit=prefix_match_unit,
            kv_cache_layout=kv_cache_layout,
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            prefill_context_parallel_size=pcp,
            decode_context_parallel_size=dcp,
            **parallel,
        ),
        kv_transfer_config=(
            KVTransferConfig(kv_connector_extra_config=extra or {}, engine_id="engine-0")
            if transfer
            else None
        ),
        kv_events_config=events,
        use_v2_model_runner=v2,
    )


def build(kv: KVCacheConfig, extra: dict | None = None, **engine_kw: Any):
    return build_offloading_config(engine(extra, **engine_kw), kv)
