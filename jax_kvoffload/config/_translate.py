"""`build_offloading_config`: vLLM 0.33.0's translation and certification, rule by rule.

Source: `vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py` (spec section
3). The steps run in vLLM's order, so the first failing rule is the one reported. Where
vLLM asserts, a typed `OffloadConfigError` (a `ValueError`) is raised with vLLM's text.

Inputs are read by attribute only, with vLLM's attribute names: this module's own
`EngineConfig` / `KVCacheConfig`, or objects shaped like vLLM's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
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
    ChunkSizeOverflowError,
    ConfigFieldError,
    ConfigTypeError,
    MissingTransferConfigError,
    NoEligibleGroupsError,
    NonUniformBlockSizeError,
    TokensPerHashError,
    WindowSpecError,
    ZeroChunkSizeError,
)
from jax_kvoffload.config._gates import (
    Verdict,
    agnostic_checks,
    canonical_agnostic_checks,
    canonical_replicated_checks,
    passes,
    replicated_checks,
    verdicts,
)
from jax_kvoffload.config._kv_cache import KVCacheGroupRole
from jax_kvoffload.config._specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    iter_layer_specs,
    round_up,
)
from jax_kvoffload.config._validate import show


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
            raise WindowSpecError(
                f"sliding_window must be positive, got {window} ({type(spec).__name__}); "
                "give the model's window in tokens (vLLM asserts here)"
            )
        _check_chunk_tokens(tokens_per_chunk)
        return max(
            cdiv(window, tokens_per_chunk),
            cdiv(window - 1 + spec.extra_retained_tokens, tokens_per_chunk),
        )
    if isinstance(spec, ChunkedLocalAttentionSpec):
        if spec.attention_chunk_size <= 0:
            raise WindowSpecError(
                f"attention_chunk_size must be positive, got {spec.attention_chunk_size}; "
                "give the model's attention chunk in tokens (vLLM asserts here)"
            )
        _check_chunk_tokens(tokens_per_chunk)
        return cdiv(spec.attention_chunk_size, tokens_per_chunk)
    if isinstance(spec, MambaSpec):
        return 1
    if not isinstance(spec, FullAttentionSpec):
        raise WindowSpecError(
            f"cannot offload a group of {type(spec).__name__}: only full attention, "
            "sliding window, chunked local attention and Mamba groups have a defined "
            "window (vLLM asserts here); set enable_kv_transfer=False on that group"
        )
    return None


def _check_chunk_tokens(tokens_per_chunk: int) -> None:
    # vLLM divides by zero here after `block_size: 0`; say what happened instead (still a
    # ZeroDivisionError, so code that caught vLLM's keeps working).
    if tokens_per_chunk == 0:
        raise ZeroChunkSizeError(
            "a sliding-window or chunked-local group needs a positive chunk size, got 0 "
            "tokens per chunk (from 'block_size': 0 in kv_connector_extra_config); set "
            "'block_size' to a positive multiple of the GPU block size"
        )


def group_kv_bytes_per_block(group: Any) -> int:
    """Bytes one worker stores per block for a group: the same for a per-layer wrapper
    (worker side) and a flattened representative spec (scheduler side)."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.page_size_bytes
    size: int = spec.page_size_bytes * len(group.layer_names)
    return size


def _parse_int(extra: Mapping[str, Any], key: str) -> int:
    """`int(extra[key])` as vLLM computes it, with errors in the families `int()` raises:
    TypeError for a list or dict, ValueError for an unparsable string, OverflowError for
    an infinite float. Non-integral floats, which `int()` truncates, are refused."""
    value = extra[key]
    field = f"kv_connector_extra_config[{key!r}]"
    fix = f"set it to a positive integer, e.g. {{{key!r}: 4}}"
    finite = isinstance(value, float) and math.isfinite(value)
    if finite and not value.is_integer():
        raise ChunkSizeError(
            f"{field}={value!r} is not a whole number (vLLM would truncate it to "
            f"{int(value)}); {fix}"
        )
    try:
        return int(value)
    except TypeError:
        raise ConfigTypeError(
            field,
            f"must be an integer or a string of one, got {type(value).__name__} "
            f"{show(value)}; {fix}",
        ) from None
    except OverflowError:
        raise ChunkSizeOverflowError(f"{field}={value!r} is not a finite number; {fix}") from None
    except ValueError:
        raise ChunkSizeError(f"{field}={show(value)} is not an integer; {fix}") from None


def _blocks_per_chunk(extra: Mapping[str, Any], tokens_per_block: list[int]) -> int:
    if extra.get("blocks_per_chunk") is not None and extra.get("block_size") is not None:
        raise ChunkSizeError(
            "Specify only one of 'block_size' or 'blocks_per_chunk' in kv_connector_extra_config."
        )
    if extra.get("blocks_per_chunk") is not None:
        blocks_per_chunk = _parse_int(extra, "blocks_per_chunk")
        if blocks_per_chunk <= 0:
            raise ChunkSizeError(
                f"'blocks_per_chunk' must be greater than 0. Got {blocks_per_chunk}; use 1 or more."
            )
        return blocks_per_chunk
    if extra.get("block_size") is not None:
        tokens_per_chunk = _parse_int(extra, "block_size")
        sizes = tuple(tokens_per_block)
        if len(set(sizes)) != 1:
            raise NonUniformBlockSizeError(sizes)
        tpb = sizes[0]
        if tpb == 0:  # a spec with block_size 0: vLLM divides by zero here
            raise ZeroChunkSizeError(
                f"'block_size'={tokens_per_chunk} cannot be split into GPU blocks of 0 "
                "tokens; the KV cache spec's block_size must be positive"
            )
        if tokens_per_chunk % tpb != 0:
            raise ChunkMultipleError(
                tokens_per_chunk=tokens_per_chunk,
                tokens_per_block=tpb,
                suggested=round_up(tokens_per_chunk, tpb),
            )
        # No positivity check here, as in vLLM: 'block_size': 0 gives 0 blocks per chunk.
        # A negative size, which vLLM passes on as a negative chunk, is refused.
        if tokens_per_chunk < 0:
            raise ChunkSizeError(
                f"'block_size' must be >= 0 in kv_connector_extra_config. Got "
                f"{tokens_per_chunk}, which would give {tokens_per_chunk // tpb} "
                f"blocks per chunk; use a positive multiple of {tpb}."
            )
        return tokens_per_chunk // tpb
    return 1


def _check_block_sizes(kv_cache_config: Any) -> None:
    # vLLM computes on with a spec of block_size <= 0 (its constructors accept one) and
    # later returns groups spanning no tokens or divides by zero, depending on the
    # groups; a block holds at least one token, so say so before anything else.
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        for spec in (group.kv_cache_spec, *iter_layer_specs(group.kv_cache_spec)):
            if spec.block_size < 1:
                raise ConfigFieldError(
                    f"kv_cache_groups[{i}].kv_cache_spec.block_size",
                    f"is {spec.block_size} ({type(spec).__name__}); a block holds at least "
                    "one token: use the engine's block size in tokens",
                )


def _worker_kv_bytes_per_block(kv_cache_config: Any, selected: list[tuple[int, Any]]) -> int:
    if (
        kv_cache_config.hisparse_host_num_blocks is None
        and kv_cache_config.num_blocks > 0
        and kv_cache_config.kv_cache_tensors
    ):
        # Every tensor describes placement inside one backing allocation: the first
        # tensor's size is the whole of it (non-offloaded groups and padding included).
        whole: int = kv_cache_config.kv_cache_tensors[0].size // kv_cache_config.num_blocks
        return whole
    if kv_cache_config.num_blocks > 0:
        return sum(group_kv_bytes_per_block(group) for _, group in selected)
    return 0


@dataclass(frozen=True)
class Certification:
    """The three layout flags and the checks that decided them (for `explain`)."""

    canonical_layout: bool
    is_parallelism_agnostic: bool
    replicated_layout: bool
    agnostic: tuple[Verdict, ...]
    canonical_agnostic: tuple[Verdict, ...] | None
    replicated: tuple[Verdict, ...]


def certify(
    engine_config: Any, kv_cache_config: Any, selected: list[tuple[int, Any]], worker_bytes: int
) -> Certification:
    """Rules 8-11: replicated layout, canonical layout, parallelism agnosticism."""
    extra = engine_config.kv_transfer_config.kv_connector_extra_config
    # vLLM evaluates the default replicated chain even when the canonical path then
    # recomputes the flag, so its attribute reads (nnodes_within_dp, which may raise)
    # happen in both cases; evaluate it the same way, in the same order.
    default_replicated = replicated_checks(engine_config, kv_cache_config, worker_bytes)
    replicated = passes(default_replicated)
    canonical_layout = bool(extra.get("canonical_layout", False))
    agnostic_gate = agnostic_checks(engine_config, kv_cache_config)
    agnostic = passes(agnostic_gate)
    canonical_gate = None
    # Canonical pages are topology-free: the gate widens to configs whose every layer
    # certifies (vLLM checks this statically; registration re-derives per layer).
    if canonical_layout and not agnostic:
        canonical_gate = canonical_agnostic_checks(engine_config, kv_cache_config)
        agnostic = passes(canonical_gate)
    replicated_gate = default_replicated
    if canonical_layout:
        # Recomputed from spec types; the default-path value is discarded.
        replicated_gate = canonical_replicated_checks(engine_config, selected, agnostic)
        replicated = passes(replicated_gate)
    return Certification(
        canonical_layout=canonical_layout,
        is_parallelism_agnostic=agnostic,
        replicated_layout=replicated,
        agnostic=verdicts(agnostic_gate),
        canonical_agnostic=None if canonical_gate is None else verdicts(canonical_gate),
        replicated=verdicts(replicated_gate),
    )


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
    extra = transfer.kv_connector_extra_config
    if transfer.engine_id is None:
        raise MissingTransferConfigError("kv_transfer_config.engine_id must be set")
    # From here on every engine attribute is read where vLLM reads it, not before: an
    # engine object may compute attributes lazily (vLLM's `nnodes_within_dp` raises for
    # some data-parallel layouts) and vLLM's answer depends on which it asks for.
    parallel = engine_config.parallel_config

    selected = [
        (gid, kv_cache_config.kv_cache_groups[gid])
        for gid in get_offloading_group_ids(kv_cache_config)
    ]
    if not selected:
        raise NoEligibleGroupsError()
    _check_block_sizes(kv_cache_config)
    dcp = parallel.decode_context_parallel_size
    tokens_per_block = [resolve_dcp_kv_block_size(g.kv_cache_spec, dcp) for _, g in selected]

    _, tokens_per_hash = resolve_kv_cache_block_sizes(kv_cache_config, engine_config)
    for tpb, (gid, _) in zip(tokens_per_block, selected, strict=True):
        if tpb % tokens_per_hash != 0:
            raise TokensPerHashError(
                group_id=gid, tokens_per_block=tpb, tokens_per_hash=tokens_per_hash
            )

    blocks_per_chunk = _blocks_per_chunk(extra, tokens_per_block)
    groups = tuple(
        OffloadingGroupConfig(
            tpb,
            tuple(g.layer_names),
            gid,
            get_sliding_window_size_in_chunks(
                next(iter_layer_specs(g.kv_cache_spec)), tpb * blocks_per_chunk
            ),
        )
        for tpb, (gid, g) in zip(tokens_per_block, selected, strict=True)
    )

    worker_bytes = _worker_kv_bytes_per_block(kv_cache_config, selected)
    certification = certify(engine_config, kv_cache_config, selected, worker_bytes)

    events = engine_config.kv_events_config
    cache_config = engine_config.cache_config
    cache_dtype = (
        engine_config.model_config.dtype
        if cache_config.cache_dtype == "auto"
        else cache_config.cache_dtype
    )
    model = engine_config.model_config
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
            world_size=parallel.world_size,
            tp_size=parallel.tensor_parallel_size,
            pp_size=parallel.pipeline_parallel_size,
            pcp_size=parallel.prefill_context_parallel_size,
            dcp_size=dcp,
            data_parallel_index=parallel.data_parallel_index,
            data_parallel_size=parallel.data_parallel_size,
            data_parallel_rank_local=parallel.data_parallel_rank_local,
            is_parallelism_agnostic=certification.is_parallelism_agnostic,
        ),
        replicated_layout=certification.replicated_layout,
        canonical_layout=certification.canonical_layout,
    ).with_layout_as_given(engine_config.cache_config.kv_cache_layout)
