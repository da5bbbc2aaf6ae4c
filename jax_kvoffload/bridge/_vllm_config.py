"""vLLM config objects -> this library's config model, by attribute, without importing vLLM.

`offloading_config_from_vllm` reads exactly what vLLM's `build_offloading_config` reads,
converts it to `jax_kvoffload.config` objects (torch dtypes become names, vLLM spec
classes map to ours by class name along the MRO), and runs our translation. Neither vLLM
nor torch is imported: objects with only the attributes named below work too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_kvoffload.config import (
    CacheConfig,
    EngineConfig,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    KVEventsConfig,
    KVTransferConfig,
    MissingTransferConfigError,
    ModelConfig,
    OffloadingConfig,
    ParallelConfig,
    build_offloading_config,
)
from jax_kvoffload.config import _specs as specs

# vLLM class name -> ours. Names, not classes, so that vLLM need not be importable.
_SPEC_CLASSES: dict[str, type[KVCacheSpec]] = {
    cls.__name__: cls
    for cls in (
        specs.FullAttentionSpec,
        specs.MLAAttentionSpec,
        specs.HiddenStateCacheSpec,
        specs.SlidingWindowSpec,
        specs.SlidingWindowMLASpec,
        specs.ChunkedLocalAttentionSpec,
        specs.CircularBufferSpec,
        specs.EncoderOnlyAttentionSpec,
        specs.CrossAttentionSpec,
        specs.SinkFullAttentionSpec,
        specs.RSWASpec,
        specs.MambaSpec,
        specs.HiSparseHotSpec,
        specs.HiSparseResidentSpec,
        specs.UniformTypeKVCacheSpecs,
    )
}


def _dtype_name(value: Any) -> str:
    # torch.bfloat16 -> "bfloat16"; strings pass through.
    return str(value).removeprefix("torch.")


def _enum_value(value: Any) -> Any:
    return getattr(value, "value", value)


def _our_spec_class(spec: Any) -> type[KVCacheSpec]:
    for cls in type(spec).__mro__:
        ours = _SPEC_CLASSES.get(cls.__name__)
        if ours is None:
            continue
        if ours is specs.MLAAttentionSpec and type(spec).__name__ != "MLAAttentionSpec":
            # The rules test `type(spec) is MLAAttentionSpec`: an unknown MLA subclass
            # must stay a subclass, and HiddenStateCacheSpec is ours with that behaviour.
            return specs.HiddenStateCacheSpec
        return ours
    raise TypeError(
        f"unsupported KV cache spec {type(spec).__name__}: it derives from none of "
        f"{sorted(_SPEC_CLASSES)}"
    )


def convert_spec(spec: Any) -> KVCacheSpec:
    """One vLLM KV cache spec (or an object with its fields) as ours."""
    cls = _our_spec_class(spec)
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if not hasattr(spec, field.name):
            continue
        value = getattr(spec, field.name)
        if field.name == "dtype":
            value = _dtype_name(value)
        elif field.name == "dtypes":
            value = tuple(_dtype_name(d) for d in value)
        elif field.name == "shapes":
            value = tuple(tuple(int(d) for d in s) for s in value)
        elif field.name == "kv_cache_specs":
            value = {name: convert_spec(inner) for name, inner in value.items()}
        elif field.name in ("kv_quant_mode",):
            value = int(value)
        elif field.name in ("cache_role", "mamba_type"):
            value = str(_enum_value(value))
        elif field.name == "block_stride_alignment" and value is not None:
            value = int(getattr(value, "value", value))
        kwargs[field.name] = value
    if cls is specs.UniformTypeKVCacheSpecs:
        kwargs.pop("dcp_sharded", None)  # derived from the first inner spec
    return cls(**kwargs)


def convert_kv_cache_config(kv_cache_config: Any) -> KVCacheConfig:
    """vLLM's `KVCacheConfig` (tensors, groups, specs) as ours."""
    tensors = tuple(
        KVCacheTensor(
            size=int(t.size),
            layers=tuple(t.layers),
            layer_stride=int(t.layer_stride),
            block_stride=int(t.block_stride),
            offset=int(getattr(t, "offset", 0)),
            host_resident=bool(getattr(t, "host_resident", False)),
        )
        for t in kv_cache_config.kv_cache_tensors
    )
    groups = tuple(
        KVCacheGroupSpec(
            layer_names=tuple(g.layer_names),
            kv_cache_spec=convert_spec(g.kv_cache_spec),
            is_eagle_group=bool(getattr(g, "is_eagle_group", False)),
            host_resident=bool(getattr(g, "host_resident", False)),
            enable_kv_transfer=bool(getattr(g, "enable_kv_transfer", True)),
            role=KVCacheGroupRole(_enum_value(getattr(g, "role", "default"))),
        )
        for g in kv_cache_config.kv_cache_groups
    )
    return KVCacheConfig(
        num_blocks=int(kv_cache_config.num_blocks),
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        hisparse_host_num_blocks=kv_cache_config.hisparse_host_num_blocks,
        kv_tp_replicas=int(getattr(kv_cache_config, "kv_tp_replicas", 1)),
    )


def _backend_name(backend: Any) -> str | None:
    if backend is None or isinstance(backend, str):
        return backend
    # An Executor class: only `== "mp"` is ever tested, so any other label is exact.
    return f"class:{getattr(backend, '__qualname__', type(backend).__name__)}"


def convert_engine_config(vllm_config: Any) -> EngineConfig:
    """The parts of a `VllmConfig` that the translation reads, as our `EngineConfig`."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    transfer = vllm_config.kv_transfer_config
    events = vllm_config.kv_events_config
    layout = cache.kv_cache_layout
    return EngineConfig(
        model_config=ModelConfig(
            model=str(model.model),
            dtype=_dtype_name(model.dtype),
            total_num_kv_heads=int(model.get_total_num_kv_heads()),
            use_mla=bool(model.use_mla),
            max_model_len=int(model.max_model_len or 0),
        ),
        cache_config=CacheConfig(
            block_size=int(cache.block_size),
            cache_dtype=_dtype_name(cache.cache_dtype),
            enable_prefix_caching=bool(cache.enable_prefix_caching),
            prefix_match_unit=cache.prefix_match_unit,
            kv_cache_layout=getattr(layout, "name", layout),
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=parallel.tensor_parallel_size,
            pipeline_parallel_size=parallel.pipeline_parallel_size,
            prefill_context_parallel_size=parallel.prefill_context_parallel_size,
            decode_context_parallel_size=parallel.decode_context_parallel_size,
            data_parallel_size=parallel.data_parallel_size,
            data_parallel_index=parallel.data_parallel_index,
            data_parallel_rank_local=parallel.data_parallel_rank_local,
            rank=parallel.rank,
            world_size=parallel.world_size,
            distributed_executor_backend=_backend_name(parallel.distributed_executor_backend),
            nnodes_within_dp=parallel.nnodes_within_dp,
        ),
        kv_transfer_config=(
            None
            if transfer is None
            else KVTransferConfig(
                kv_connector=str(getattr(transfer, "kv_connector", None) or ""),
                kv_role=str(getattr(transfer, "kv_role", None) or ""),
                kv_connector_extra_config=transfer.kv_connector_extra_config or {},
                engine_id=transfer.engine_id,
            )
        ),
        kv_events_config=(
            None
            if events is None
            else KVEventsConfig(enable_kv_cache_events=bool(events.enable_kv_cache_events))
        ),
        use_v2_model_runner=bool(vllm_config.use_v2_model_runner),
    )


def offloading_config_from_vllm(vllm_config: Any, kv_cache_config: Any) -> OffloadingConfig:
    """vLLM 0.33.0's objects in, our `OffloadingConfig` out (equal to vLLM's own result).

    Args:
      vllm_config: a `VllmConfig`, or any object exposing `model_config` (`model`,
        `dtype`, `use_mla`, `max_model_len`, `get_total_num_kv_heads()`),
        `parallel_config`, `cache_config`, `kv_transfer_config`, `kv_events_config` and
        `use_v2_model_runner`.
      kv_cache_config: vLLM's `KVCacheConfig` with vLLM's spec classes.

    Raises:
      OffloadConfigError: wherever vLLM raises or asserts, as `build_offloading_config`.
    """
    transfer = vllm_config.kv_transfer_config
    if transfer is not None and transfer.engine_id is None:
        # Report it here: our KVTransferConfig would invent a uuid, vLLM asserts.
        raise MissingTransferConfigError("kv_transfer_config.engine_id must be set")
    return build_offloading_config(
        convert_engine_config(vllm_config), convert_kv_cache_config(kv_cache_config)
    )
