"""Builds vLLM 0.33.0's own config objects from ours (used only when vLLM is importable).

Sub-configs are vLLM's real classes; `VllmConfig` itself cannot be built on a CPU-only
machine, so a namespace exposes the attributes the translation reads (see the reference
notes on running vLLM on CPU).
"""

from __future__ import annotations

import dataclasses
import types

import torch
from vllm.config import CacheConfig, KVEventsConfig, KVTransferConfig, ParallelConfig
from vllm.v1 import kv_cache_interface as kci

from jax_kvoffload import config as ours


def torch_dtype(dtype) -> torch.dtype:
    return getattr(torch, str(dtype))


def spec(s: ours.KVCacheSpec):
    cls = getattr(kci, type(s).__name__)
    kwargs = {}
    for f in dataclasses.fields(s):
        value = getattr(s, f.name)
        if f.name in ("cache_role", "mamba_type", "is_draft"):
            continue  # defaults on both sides
        if f.name == "dtype":
            value = torch_dtype(value)
        elif f.name == "dtypes":
            value = tuple(torch_dtype(d) for d in value)
        elif f.name == "kv_quant_mode":
            value = kci.KVQuantMode(int(value))
        elif f.name == "kv_cache_specs":
            value = {k: spec(v) for k, v in value.items()}
        elif f.name == "dcp_sharded" and isinstance(s, ours.UniformTypeKVCacheSpecs):
            continue
        elif f.name == "page_size_padded" and getattr(s, "alignment", None) is not None:
            continue  # recomputed by vLLM's post-init from `alignment`
        kwargs[f.name] = value
    return cls(**kwargs)


def kv_cache_config(kv: ours.KVCacheConfig):
    return kci.KVCacheConfig(
        num_blocks=kv.num_blocks,
        kv_cache_tensors=[
            kci.KVCacheTensor(
                size=t.size,
                layers=list(t.layers),
                layer_stride=t.layer_stride,
                block_stride=t.block_stride,
                offset=t.offset,
            )
            for t in kv.kv_cache_tensors
        ],
        kv_cache_groups=[
            kci.KVCacheGroupSpec(
                layer_names=list(g.layer_names),
                kv_cache_spec=spec(g.kv_cache_spec),
                host_resident=g.host_resident,
                enable_kv_transfer=g.enable_kv_transfer,
                role=kci.KVCacheGroupRole(g.role.value),
            )
            for g in kv.kv_cache_groups
        ],
        hisparse_host_num_blocks=kv.hisparse_host_num_blocks,
        kv_tp_replicas=kv.kv_tp_replicas,
    )


def vllm_config(engine: ours.EngineConfig, extra: dict | None = None):
    p = engine.parallel_config
    parallel = ParallelConfig(
        tensor_parallel_size=p.tensor_parallel_size,
        pipeline_parallel_size=p.pipeline_parallel_size,
        prefill_context_parallel_size=p.prefill_context_parallel_size,
        decode_context_parallel_size=p.decode_context_parallel_size,
    )
    # Attributes vLLM computes or refuses on this machine are set after construction.
    parallel.world_size = p.world_size
    parallel.rank = p.rank
    parallel.data_parallel_size = p.data_parallel_size
    parallel.data_parallel_rank = p.data_parallel_index
    parallel.data_parallel_index = p.data_parallel_index
    parallel.data_parallel_rank_local = p.data_parallel_rank_local
    parallel.distributed_executor_backend = p.distributed_executor_backend
    if p.nnodes_within_dp != 1:
        parallel.nnodes = p.nnodes_within_dp
    c = engine.cache_config
    cache = CacheConfig(
        block_size=c.block_size,
        cache_dtype=c.cache_dtype,
        enable_prefix_caching=c.enable_prefix_caching,
    )
    cache.prefix_match_unit = c.prefix_match_unit
    cache.kv_cache_layout = c.kv_cache_layout
    m = engine.model_config
    model = types.SimpleNamespace(
        model=m.model,
        dtype=torch_dtype(m.dtype),
        use_mla=m.use_mla,
        max_model_len=m.max_model_len,
        get_total_num_kv_heads=lambda: m.total_num_kv_heads,
    )
    t = engine.kv_transfer_config
    transfer = None
    if t is not None:
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=dict(
                extra if extra is not None else t.kv_connector_extra_config
            ),
            engine_id=t.engine_id,
        )
    events = None
    if engine.kv_events_config is not None:
        events = KVEventsConfig(
            enable_kv_cache_events=engine.kv_events_config.enable_kv_cache_events
        )
    return types.SimpleNamespace(
        model_config=model,
        cache_config=cache,
        parallel_config=parallel,
        kv_transfer_config=transfer,
        kv_events_config=events,
        use_v2_model_runner=engine.use_v2_model_runner,
    )


def as_plain(offloading_config) -> dict:
    """vLLM's OffloadingConfig (or ours) as comparable plain data."""
    from jax_kvoffload.config.internals import thaw

    out = {}
    for f in dataclasses.fields(offloading_config):
        value = getattr(offloading_config, f.name)
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        elif f.name == "groups":
            value = [dataclasses.asdict(g) for g in value]
        out[f.name] = thaw(value)
    return out


def ours_validated_kv_cache_config(kv) -> ours.KVCacheConfig:
    """vLLM's `KVCacheConfig` rebuilt through our validating constructors (the route a
    JAX engine takes), unlike the adapter's trusted copy."""

    def spec_of(s):
        cls = getattr(ours, type(s).__name__)
        kwargs = {}
        for f in dataclasses.fields(cls):
            if not f.init or not hasattr(s, f.name):
                continue
            value = getattr(s, f.name)
            if f.name == "dtype":
                value = str(value)
            elif f.name == "dtypes":
                value = tuple(str(d) for d in value)
            elif f.name == "shapes":
                value = tuple(tuple(shape) for shape in value)
            elif f.name == "kv_quant_mode":
                value = int(value)
            elif f.name in ("cache_role", "mamba_type"):
                value = str(getattr(value, "value", value))
            elif f.name == "kv_cache_specs":
                value = {name: spec_of(inner) for name, inner in value.items()}
            elif f.name == "dcp_sharded" and cls is ours.UniformTypeKVCacheSpecs:
                continue  # derived from the first inner spec, as vLLM's post-init does
            kwargs[f.name] = value
        return cls(**kwargs)

    return ours.KVCacheConfig(
        num_blocks=kv.num_blocks,
        kv_cache_tensors=[
            ours.KVCacheTensor(
                size=t.size,
                layers=t.layers,
                layer_stride=t.layer_stride,
                block_stride=t.block_stride,
                offset=t.offset,
                host_resident=t.host_resident,
            )
            for t in kv.kv_cache_tensors
        ],
        kv_cache_groups=[
            ours.KVCacheGroupSpec(
                layer_names=g.layer_names,
                kv_cache_spec=spec_of(g.kv_cache_spec),
                is_eagle_group=g.is_eagle_group,
                host_resident=g.host_resident,
                enable_kv_transfer=g.enable_kv_transfer,
                role=g.role.value,
            )
            for g in kv.kv_cache_groups
        ],
        hisparse_host_num_blocks=kv.hisparse_host_num_blocks,
        kv_tp_replicas=kv.kv_tp_replicas,
    )
