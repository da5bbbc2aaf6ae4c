"""vLLM config objects -> this library's config model, by attribute, without importing vLLM.

`offloading_config_from_vllm` gives vLLM 0.33.0's answer on vLLM's own objects: it runs
our translation on the `VllmConfig` itself (the translation reads vLLM's attribute
names), so every engine attribute is read only where and when vLLM's
`build_offloading_config` reads it (`nnodes_within_dp`, which raises for some data
parallel layouts, only at the end of the replicated-layout chain; `model_config.dtype`
only when `cache_dtype == "auto"`; the total KV head count only on the gates that compare
it; `kv_cache_layout` copied as it is). The KV cache config is copied into our classes
(vLLM spec classes map to ours by class name along the MRO, torch dtypes become numpy
dtypes) without re-validating it: vLLM validated it, and the few checks vLLM makes late
(a sliding window of 0, padding below the page) are made by the translation at the same
point. Neither vLLM nor torch is imported: objects with the attributes named below work.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from jax_kvoffload.config import (
    CacheConfig,
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    ConfigTypeError,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    EngineConfig,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    KVEventsConfig,
    KVQuantMode,
    KVTransferConfig,
    MambaSpec,
    MissingTransferConfigError,
    MLAAttentionSpec,
    ModelConfig,
    OffloadingConfig,
    ParallelConfig,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    build_offloading_config,
)
from jax_kvoffload.config.internals import FrozenDict, as_dtype, from_trusted_fields

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig as VllmKVCacheConfig

# vLLM class name -> ours. Names, not classes, so that vLLM need not be importable.
_SPEC_CLASSES: dict[str, type[KVCacheSpec]] = {
    cls.__name__: cls
    for cls in (
        FullAttentionSpec,
        MLAAttentionSpec,
        HiddenStateCacheSpec,
        SlidingWindowSpec,
        SlidingWindowMLASpec,
        ChunkedLocalAttentionSpec,
        CircularBufferSpec,
        EncoderOnlyAttentionSpec,
        CrossAttentionSpec,
        SinkFullAttentionSpec,
        RSWASpec,
        MambaSpec,
        HiSparseHotSpec,
        HiSparseResidentSpec,
        UniformTypeKVCacheSpecs,
    )
}


def _dtype_name(value: object) -> str:
    # torch.bfloat16 -> "bfloat16"; strings pass through.
    return str(value).removeprefix("torch.")


def _enum_value(value: object) -> object:
    return getattr(value, "value", value)


def _our_spec_class(spec: object) -> type[KVCacheSpec]:
    for cls in type(spec).__mro__:
        ours = _SPEC_CLASSES.get(cls.__name__)
        if ours is None:
            continue
        if ours is MLAAttentionSpec and type(spec).__name__ != "MLAAttentionSpec":
            # The rules test `type(spec) is MLAAttentionSpec`: an unknown MLA subclass
            # must stay a subclass, and HiddenStateCacheSpec is ours with that behaviour.
            return HiddenStateCacheSpec
        return ours
    raise ConfigTypeError(
        "kv_cache_spec",
        f"unsupported KV cache spec {type(spec).__name__}: it derives from none of "
        f"{sorted(_SPEC_CLASSES)}; the translation cannot say how it is offloaded",
    )


def convert_spec(spec: object) -> KVCacheSpec:
    """One vLLM KV cache spec (or an object with its fields) as ours, values as they are."""
    cls = _our_spec_class(spec)
    kwargs: dict[str, Any] = {}  # each field's value, of its own type
    for field in dataclasses.fields(cls):
        if not hasattr(spec, field.name):
            continue
        value = getattr(spec, field.name)
        if field.name == "dtype":
            value = as_dtype(_dtype_name(value), "dtype")
        elif field.name == "dtypes":
            value = tuple(as_dtype(_dtype_name(d), "dtypes[]") for d in value)
        elif field.name == "shapes":
            value = tuple(tuple(s) for s in value)
        elif field.name == "kv_cache_specs":
            value = FrozenDict(
                {name: convert_spec(inner) for name, inner in value.items()},
                name="kv_cache_specs",
            )
        elif field.name == "kv_quant_mode":
            value = KVQuantMode(int(value))
        elif field.name in ("cache_role", "mamba_type"):
            value = str(_enum_value(value))
        kwargs[field.name] = value
    if cls is UniformTypeKVCacheSpecs and "dcp_sharded" not in kwargs:
        # vLLM's post-init copies it from the first inner spec.
        kwargs["dcp_sharded"] = next(iter(kwargs["kv_cache_specs"].values())).dcp_sharded
    if kwargs.get("head_size_v", 0) is None or (
        "head_size_v" not in kwargs and _default(cls, "head_size_v") is None
    ):
        kwargs["head_size_v"] = kwargs.get("head_size")  # vLLM's AttentionSpec post-init
    return from_trusted_fields(cls, **kwargs)


def _default(cls: type, name: str) -> object:
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.default
    return dataclasses.MISSING


def convert_kv_cache_config(kv_cache_config: VllmKVCacheConfig) -> KVCacheConfig:
    """vLLM's `KVCacheConfig` (tensors, groups, specs) as ours, without re-validating it."""
    tensors = tuple(
        from_trusted_fields(
            KVCacheTensor,
            size=t.size,
            layers=tuple(t.layers),
            layer_stride=t.layer_stride,
            block_stride=t.block_stride,
            offset=getattr(t, "offset", 0),
            host_resident=getattr(t, "host_resident", False),
        )
        for t in kv_cache_config.kv_cache_tensors
    )
    groups = tuple(
        from_trusted_fields(
            KVCacheGroupSpec,
            layer_names=tuple(g.layer_names),
            kv_cache_spec=convert_spec(g.kv_cache_spec),
            is_eagle_group=getattr(g, "is_eagle_group", False),
            host_resident=getattr(g, "host_resident", False),
            enable_kv_transfer=getattr(g, "enable_kv_transfer", True),
            role=KVCacheGroupRole(_enum_value(getattr(g, "role", "default"))),
        )
        for g in kv_cache_config.kv_cache_groups
    )
    return from_trusted_fields(
        KVCacheConfig,
        num_blocks=kv_cache_config.num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        hisparse_host_num_blocks=kv_cache_config.hisparse_host_num_blocks,
        kv_tp_replicas=getattr(kv_cache_config, "kv_tp_replicas", 1),
    )


def _backend_name(backend: object) -> str | None:
    if backend is None or isinstance(backend, str):
        return backend
    # An Executor class: only `== "mp"` is ever tested, so any other label is exact.
    return f"class:{getattr(backend, '__qualname__', type(backend).__name__)}"


def convert_engine_config(vllm_config: VllmConfig) -> EngineConfig:
    """The parts of a `VllmConfig` the translation reads, as our (validated) `EngineConfig`.

    Unlike `offloading_config_from_vllm`, this reads every attribute up front, so it
    raises where a property of vLLM's raises (e.g. `nnodes_within_dp` for a data-parallel
    layout whose node count does not divide) even if the translation would not ask.
    """
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    transfer = vllm_config.kv_transfer_config
    events = vllm_config.kv_events_config
    return EngineConfig(
        model_config=ModelConfig(
            model=model.model,
            dtype=_dtype_name(model.dtype),  # type: ignore[arg-type]  # a name: as_dtype
            total_num_kv_heads=model.get_total_num_kv_heads(),
            use_mla=model.use_mla,
            max_model_len=model.max_model_len,
        ),
        cache_config=CacheConfig(
            block_size=cache.block_size,
            cache_dtype=_dtype_name(cache.cache_dtype),
            enable_prefix_caching=cache.enable_prefix_caching,
            prefix_match_unit=cache.prefix_match_unit,
            kv_cache_layout=cache.kv_cache_layout,
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
                kv_connector_extra_config=transfer.kv_connector_extra_config,
                engine_id=transfer.engine_id,
            )
        ),
        kv_events_config=(
            None
            if events is None
            else KVEventsConfig(enable_kv_cache_events=events.enable_kv_cache_events)
        ),
        use_v2_model_runner=vllm_config.use_v2_model_runner,
    )


def offloading_config_from_vllm(
    vllm_config: VllmConfig, kv_cache_config: VllmKVCacheConfig
) -> OffloadingConfig:
    """vLLM 0.33.0's objects in, our `OffloadingConfig` out (equal to vLLM's own result).

    Args:
      vllm_config: a `VllmConfig`, or any object exposing `model_config` (`model`,
        `dtype`, `use_mla`, `max_model_len`, `get_total_num_kv_heads()`),
        `parallel_config`, `cache_config`, `kv_transfer_config`, `kv_events_config` and
        `use_v2_model_runner`. Read lazily, as vLLM reads it.
      kv_cache_config: vLLM's `KVCacheConfig` with vLLM's spec classes.

    Raises:
      KVOffloadError: wherever vLLM raises or asserts, in vLLM's exception family: an
        `OffloadConfigError` (a `ValueError`) for vLLM's ValueErrors and assertions, a
        `ConfigTypeError` (a `TypeError`) where `int()` gets a list or dict, and the
        `ChunkSizeError` subclasses that are also `OverflowError` / `ZeroDivisionError`.
        docs/config.md lists the few inputs answered differently, on purpose.
    """
    # vLLM asserts these first; check them before converting anything else.
    transfer = vllm_config.kv_transfer_config
    if transfer is None:
        raise MissingTransferConfigError(
            "kv_transfer_config is required for offloading; set one with "
            "kv_connector='OffloadingConnector'"
        )
    transfer.kv_connector_extra_config  # noqa: B018 -- read before the id, as vLLM does
    if transfer.engine_id is None:
        raise MissingTransferConfigError(
            "kv_transfer_config.engine_id must be set (vLLM fills in a uuid when it is None)"
        )
    return build_offloading_config(vllm_config, convert_kv_cache_config(kv_cache_config))
