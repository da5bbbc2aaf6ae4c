"""`build_offloading_config`: vLLM 0.33.0's translation and certification, rule by rule.

Source: `vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py` (spec section
3). The steps run in vLLM's order, so the first failing rule is the one reported. Where
vLLM asserts, a typed `OffloadConfigError` (a `ValueError`) is raised with vLLM's text.

Inputs are read by attribute only, with vLLM's attribute names: this module's own
`EngineConfig` / `KVCacheConfig`, or objects shaped like vLLM's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jax_kvoffload.config._block_sizes import (
    resolve_dcp_kv_block_size,
    resolve_kv_cache_block_sizes,
)
from jax_kvoffload.config._boundary import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from jax_kvoffload.config._errors import (
    ChunkMultipleError,
    ChunkSizeError,
    MissingTransferConfigError,
    NoEligibleGroupsError,
    NonUniformBlockSizeError,
    TokensPerHashError,
    WindowSpecError,
)
from jax_kvoffload.config._kv_cache import KVCacheGroupRole
from jax_kvoffload.config._specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    iter_layer_specs,
    round_up,
)


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def get_offloading_group_ids(kv_cache_config: Any) -> tuple[int, ...]:
    """Prefix-cacheable transfer groups; with HiSparse, exactly the indexer groups."""
    if kv_cache_config.hisparse_host_num_blocks is None:
        return tuple(kv_cache_config.prefix_cacheable_group_ids)
    return tuple(
        i
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
        if g.role is KVCacheGroupRole.HISPARSE_INDEXER
    )


def get_sliding_window_size_in_chunks(spec: KVCacheSpec, tokens_per_chunk: int) -> int | None:
    """Trailing chunks a request needs of a group whose first layer has `spec`."""
    if isinstance(spec, SlidingWindowSpec):
        window = spec.sliding_window
        if window <= 0:
            raise WindowSpecError(f"sliding_window must be positive, got {window}")
        _check_chunk_tokens(tokens_per_chunk)
        return max(
            cdiv(window, tokens_per_chunk),
            cdiv(window - 1 + spec.extra_retained_tokens, tokens_per_chunk),
        )
    if isinstance(spec, ChunkedLocalAttentionSpec):
        if spec.attention_chunk_size <= 0:
            raise WindowSpecError(
                f"attention_chunk_size must be positive, got {spec.attention_chunk_size}"
            )
        _check_chunk_tokens(tokens_per_chunk)
        return cdiv(spec.attention_chunk_size, tokens_per_chunk)
    if isinstance(spec, MambaSpec):
        return 1
    if not isinstance(spec, FullAttentionSpec):
        raise WindowSpecError(
            f"cannot offload a group of {type(spec).__name__}: only full attention, "
            "sliding window, chunked local attention and Mamba groups have a defined "
            "window (vLLM asserts here)"
        )
    return None


def _check_chunk_tokens(tokens_per_chunk: int) -> None:
    # vLLM divides by zero here after `block_size: 0`; say what happened instead.
    if tokens_per_chunk <= 0:
        raise ChunkSizeError(
            f"a window group needs a positive chunk size, got {tokens_per_chunk} tokens "
            "per chunk (from 'block_size': 0 in kv_connector_extra_config)"
        )


def group_kv_bytes_per_block(group: Any) -> int:
    """Bytes one worker stores per block for a group: the same for a per-layer wrapper
    (worker side) and a flattened representative spec (scheduler side)."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.page_size_bytes
    return spec.page_size_bytes * len(group.layer_names)


def spec_certifiable(spec: KVCacheSpec, tp_size: int, total_kv_heads: int) -> bool:
    """Conservative static mirror of the canonical mapping's per-layer checks (spec 3.10)."""
    if not isinstance(spec, AttentionSpec):
        return False
    if spec.kv_quant_mode.is_per_token_head:
        return False
    if type(spec) is MLAAttentionSpec:
        return spec.tokens_per_state == 1 and spec.real_page_size_bytes % spec.block_size == 0
    if isinstance(spec, (SlidingWindowMLASpec, MLAAttentionSpec)):
        return False
    if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
        return False
    heads_divide = total_kv_heads % tp_size == 0 or tp_size % total_kv_heads == 0
    return heads_divide and spec.num_kv_heads == max(1, total_kv_heads // tp_size)


def _parse_int(extra: Mapping[str, Any], key: str) -> int:
    value = extra[key]
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ChunkSizeError(
            f"'{key}'={value!r} in kv_connector_extra_config is not an integer"
        ) from None


def _blocks_per_chunk(extra: Mapping[str, Any], groups: tuple[OffloadingGroupConfig, ...]) -> int:
    if extra.get("blocks_per_chunk") is not None and extra.get("block_size") is not None:
        raise ChunkSizeError(
            "Specify only one of 'block_size' or 'blocks_per_chunk' in kv_connector_extra_config."
        )
    if extra.get("blocks_per_chunk") is not None:
        blocks_per_chunk = _parse_int(extra, "blocks_per_chunk")
        if blocks_per_chunk <= 0:
            raise ChunkSizeError(
                f"'blocks_per_chunk' must be greater than 0. Got {blocks_per_chunk}."
            )
        return blocks_per_chunk
    if extra.get("block_size") is not None:
        tokens_per_chunk = _parse_int(extra, "block_size")
        sizes = tuple(g.tokens_per_block for g in groups)
        if len(set(sizes)) != 1:
            raise NonUniformBlockSizeError(sizes)
        tokens_per_block = sizes[0]
        if tokens_per_chunk % tokens_per_block != 0:
            raise ChunkMultipleError(
                tokens_per_chunk=tokens_per_chunk,
                tokens_per_block=tokens_per_block,
                suggested=round_up(tokens_per_chunk, tokens_per_block),
            )
        # No positivity check here, as in vLLM: 'block_size': 0 gives 0 blocks per chunk.
        return tokens_per_chunk // tokens_per_block
    return 1


def _worker_kv_bytes_per_block(kv_cache_config: Any, selected: list[tuple[int, Any]]) -> int:
    if (
        kv_cache_config.hisparse_host_num_blocks is None
        and kv_cache_config.num_blocks > 0
        and kv_cache_config.kv_cache_tensors
    ):
        # Every tensor describes placement inside one backing allocation: the first
        # tensor's size is the whole of it (non-offloaded groups and padding included).
        return kv_cache_config.kv_cache_tensors[0].size // kv_cache_config.num_blocks
    if kv_cache_config.num_blocks > 0:
        return sum(group_kv_bytes_per_block(group) for _, group in selected)
    return 0


def build_offloading_config(engine_config: Any, kv_cache_config: Any) -> OffloadingConfig:
    """Translates an engine and KV cache description into the offloading boundary.

    Args:
      engine_config: an `EngineConfig` (or an object with vLLM's `VllmConfig` attributes).
      kv_cache_config: a `KVCacheConfig` with this package's spec classes.

    Returns:
      The `OffloadingConfig` vLLM 0.33.0 would produce for the same input.

    Raises:
      OffloadConfigError: a subclass naming the rule, wherever vLLM raises or asserts.
    """
    transfer = engine_config.kv_transfer_config
    if transfer is None:
        raise MissingTransferConfigError(
            "kv_transfer_config is required for offloading; set one with "
            "kv_connector='OffloadingConnector'"
        )
    if transfer.engine_id is None:
        raise MissingTransferConfigError("kv_transfer_config.engine_id must be set")
    extra = transfer.kv_connector_extra_config
    parallel = engine_config.parallel_config
    model = engine_config.model_config
    dcp = parallel.decode_context_parallel_size

    selected = [
        (gid, kv_cache_config.kv_cache_groups[gid])
        for gid in get_offloading_group_ids(kv_cache_config)
    ]
    if not selected:
        raise NoEligibleGroupsError()
    tokens_per_block = [resolve_dcp_kv_block_size(g.kv_cache_spec, dcp) for _, g in selected]
    provisional = tuple(
        OffloadingGroupConfig(tpb, tuple(g.layer_names), gid)
        for tpb, (gid, g) in zip(tokens_per_block, selected, strict=True)
    )

    _, tokens_per_hash = resolve_kv_cache_block_sizes(kv_cache_config, engine_config)
    for group in provisional:
        if group.tokens_per_block % tokens_per_hash != 0:
            raise TokensPerHashError(
                group_id=group.group_id,
                tokens_per_block=group.tokens_per_block,
                tokens_per_hash=tokens_per_hash,
            )

    blocks_per_chunk = _blocks_per_chunk(extra, provisional)
    groups = tuple(
        OffloadingGroupConfig(
            group.tokens_per_block,
            group.layer_names,
            group.group_id,
            get_sliding_window_size_in_chunks(
                next(iter_layer_specs(g.kv_cache_spec)), group.tokens_per_block * blocks_per_chunk
            ),
        )
        for group, (_, g) in zip(provisional, selected, strict=True)
    )

    worker_bytes = _worker_kv_bytes_per_block(kv_cache_config, selected)
    all_groups = kv_cache_config.kv_cache_groups
    single_group_spec = all_groups[0].kv_cache_spec if len(all_groups) == 1 else None
    tp = parallel.tensor_parallel_size
    pp = parallel.pipeline_parallel_size
    pcp = parallel.prefill_context_parallel_size
    world = parallel.world_size

    replicated_layout = (
        model.use_mla
        and tp > 1
        and kv_cache_config.kv_tp_replicas == tp
        and worker_bytes > 0
        # vLLM's MVP boundary: TP only, single-node shared-memory executor.
        and pp == 1
        and pcp == 1
        and dcp == 1
        and world == tp
        and parallel.distributed_executor_backend == "mp"
        and parallel.nnodes_within_dp == 1
    )

    canonical_layout = bool(extra.get("canonical_layout", False))
    total_kv_heads = model.get_total_num_kv_heads()
    # Only one non-MLA full-attention group with genuinely head-sharded pages is
    # portable as-is; PP and world size are deliberately not checked (vLLM 0.33.0).
    is_parallelism_agnostic = (
        not engine_config.use_v2_model_runner
        and single_group_spec is not None
        and isinstance(single_group_spec, FullAttentionSpec)
        and not isinstance(single_group_spec, MLAAttentionSpec)
        and single_group_spec.num_kv_heads * tp == total_kv_heads
        and not single_group_spec.kv_quant_mode.is_per_token_head
        and dcp == 1
        and pcp == 1
    )
    if canonical_layout and not is_parallelism_agnostic:
        layer_specs = [s for g in all_groups for s in iter_layer_specs(g.kv_cache_spec)]
        is_parallelism_agnostic = (
            len(layer_specs) > 0
            and all(spec_certifiable(s, tp, total_kv_heads) for s in layer_specs)
            and dcp == 1
            and pcp == 1
            and world == tp
        )
    if canonical_layout:
        replicated_layout = (
            is_parallelism_agnostic
            and all(
                type(s) is MLAAttentionSpec
                for _, g in selected
                for s in iter_layer_specs(g.kv_cache_spec)
            )
            and parallel.nnodes_within_dp == 1
            and (world == 1 or parallel.distributed_executor_backend == "mp")
        )

    events = engine_config.kv_events_config
    cache_dtype = (
        model.dtype
        if engine_config.cache_config.cache_dtype == "auto"
        else engine_config.cache_config.cache_dtype
    )
    return OffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=worker_bytes,
        enable_kv_cache_events=bool(events is not None and events.enable_kv_cache_events),
        extra_config=extra,
        engine_id=transfer.engine_id,
        model=OffloadingModelConfig(
            name=model.model,
            dtype=str(cache_dtype).removeprefix("torch."),
            max_model_len=model.max_model_len,
        ),
        cache=OffloadingCacheConfig(
            tokens_per_hash=tokens_per_hash, blocks_per_chunk=blocks_per_chunk
        ),
        parallel=OffloadingParallelConfig(
            rank=parallel.rank,
            world_size=world,
            tp_size=tp,
            pp_size=pp,
            pcp_size=pcp,
            dcp_size=dcp,
            data_parallel_index=parallel.data_parallel_index,
            data_parallel_size=parallel.data_parallel_size,
            data_parallel_rank_local=parallel.data_parallel_rank_local,
            is_parallelism_agnostic=bool(is_parallelism_agnostic),
        ),
        replicated_layout=bool(replicated_layout),
        canonical_layout=canonical_layout,
        kv_cache_layout=engine_config.cache_config.kv_cache_layout,
    )
