"""The normalized offloading boundary: vLLM 0.33.0's `vllm/v1/kv_offload/config.py`.

Same classes, same fields in the same order, same defaults (spec section 1). Differences,
all in favour of use as JAX statics: `extra_config` is a read-only `FrozenDict` (vLLM holds
the caller's dict itself), so every config is hashable; `to_dict()` / `from_dict()` give a
JSON round trip.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

from jax_kvoffload.config import _validate as v
from jax_kvoffload.config._errors import ConfigFieldError
from jax_kvoffload.config._frozen import FrozenDict, thaw


@dataclass(frozen=True)
class OffloadingGroupConfig:
    """One offloaded KV cache group.

    Attributes:
      tokens_per_block: total token span of one GPU block across all workers (DCP-scaled).
      layer_names: the group's layers, in the group's order.
      group_id: index in `KVCacheConfig.kv_cache_groups` (unfiltered).
      sliding_window_size_in_chunks: trailing chunks a request needs; None = unbounded.
    """

    tokens_per_block: int
    layer_names: tuple[str, ...]
    group_id: int
    sliding_window_size_in_chunks: int | None = None

    def __post_init__(self) -> None:
        v.check_int("tokens_per_block", self.tokens_per_block, minimum=1)
        object.__setattr__(self, "layer_names", v.check_names("layer_names", self.layer_names))
        v.check_int("group_id", self.group_id, minimum=0)
        v.check_optional_int("sliding_window_size_in_chunks", self.sliding_window_size_in_chunks)


@dataclass(frozen=True)
class OffloadingModelConfig:
    """Model identity. `dtype` is the KV cache dtype string, e.g. "bfloat16" or "fp8"."""

    name: str
    dtype: str
    max_model_len: int = 0

    def __post_init__(self) -> None:
        v.check_str("name", self.name)
        v.check_str("dtype", self.dtype)
        v.check_int("max_model_len", self.max_model_len, minimum=0)


@dataclass(frozen=True)
class OffloadingCacheConfig:
    """Hash granularity and chunk size.

    Attributes:
      tokens_per_hash: tokens per prefix-cache block hash.
      blocks_per_chunk: GPU blocks coalesced into one offload chunk (0 is possible:
        vLLM's `block_size: 0` quirk).
    """

    tokens_per_hash: int
    blocks_per_chunk: int

    def __post_init__(self) -> None:
        v.check_int("tokens_per_hash", self.tokens_per_hash, minimum=1)
        v.check_int("blocks_per_chunk", self.blocks_per_chunk, minimum=0)


@dataclass(frozen=True)
class OffloadingParallelConfig:
    """This worker's place in the parallel layout, and whether its bytes are portable."""

    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    data_parallel_index: int
    data_parallel_size: int
    data_parallel_rank_local: int | None
    is_parallelism_agnostic: bool

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "is_parallelism_agnostic":
                v.check_bool(f.name, value)
            elif f.name == "data_parallel_rank_local":
                v.check_optional_int(f.name, value, minimum=0)
            else:
                v.check_int(f.name, value, minimum=0)


@dataclass(frozen=True)
class OffloadingConfig:
    """The whole boundary: what the host store and the transfer engine are built from.

    Attributes:
      groups: the offloaded groups, in selection order.
      worker_kv_bytes_per_block: KV bytes one worker stores per block (all groups).
      enable_kv_cache_events: whether KV cache events are enabled.
      extra_config: the connector's `kv_connector_extra_config`, read-only.
      engine_id: unique per DP rank.
      replicated_layout: every worker's bytes are identical per block (one host copy).
      canonical_layout: canonical per-layer host pages requested.
      kv_cache_layout: the worker KV cache's `KVCacheLayout` name.
    """

    groups: tuple[OffloadingGroupConfig, ...]
    worker_kv_bytes_per_block: int
    enable_kv_cache_events: bool
    extra_config: Mapping[str, Any]
    engine_id: str
    model: OffloadingModelConfig
    cache: OffloadingCacheConfig
    parallel: OffloadingParallelConfig
    replicated_layout: bool = False
    canonical_layout: bool = False
    kv_cache_layout: str | None = None

    def __post_init__(self) -> None:
        groups = tuple(self.groups)
        for g in groups:
            if not isinstance(g, OffloadingGroupConfig):
                raise TypeError(f"groups[] must be OffloadingGroupConfig, got {g!r}")
        object.__setattr__(self, "groups", groups)
        v.check_int("worker_kv_bytes_per_block", self.worker_kv_bytes_per_block, minimum=0)
        v.check_bool("enable_kv_cache_events", self.enable_kv_cache_events)
        if not isinstance(self.extra_config, Mapping):
            raise TypeError(f"extra_config must be a mapping, got {self.extra_config!r}")
        object.__setattr__(self, "extra_config", FrozenDict(self.extra_config))
        v.check_str("engine_id", self.engine_id)
        for name, cls in (
            ("model", OffloadingModelConfig),
            ("cache", OffloadingCacheConfig),
            ("parallel", OffloadingParallelConfig),
        ):
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"{name} must be {cls.__name__}, got {getattr(self, name)!r}")
        v.check_bool("replicated_layout", self.replicated_layout)
        v.check_bool("canonical_layout", self.canonical_layout)
        if self.kv_cache_layout is not None:
            v.check_str("kv_cache_layout", self.kv_cache_layout)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists); `from_dict` inverts it."""
        return {
            "groups": [_plain(g) for g in self.groups],
            "worker_kv_bytes_per_block": self.worker_kv_bytes_per_block,
            "enable_kv_cache_events": self.enable_kv_cache_events,
            "extra_config": thaw(self.extra_config),
            "engine_id": self.engine_id,
            "model": _plain(self.model),
            "cache": _plain(self.cache),
            "parallel": _plain(self.parallel),
            "replicated_layout": self.replicated_layout,
            "canonical_layout": self.canonical_layout,
            "kv_cache_layout": self.kv_cache_layout,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OffloadingConfig:
        """Builds a config from `to_dict()` output; unknown or missing keys are errors."""
        _check_keys(cls, data, "OffloadingConfig")
        return cls(
            groups=tuple(
                _build(OffloadingGroupConfig, g, f"groups[{i}]")
                for i, g in enumerate(data["groups"])
            ),
            worker_kv_bytes_per_block=data["worker_kv_bytes_per_block"],
            enable_kv_cache_events=data["enable_kv_cache_events"],
            extra_config=data["extra_config"],
            engine_id=data["engine_id"],
            model=_build(OffloadingModelConfig, data["model"], "model"),
            cache=_build(OffloadingCacheConfig, data["cache"], "cache"),
            parallel=_build(OffloadingParallelConfig, data["parallel"], "parallel"),
            replicated_layout=data.get("replicated_layout", False),
            canonical_layout=data.get("canonical_layout", False),
            kv_cache_layout=data.get("kv_cache_layout"),
        )


def _plain(obj: Any) -> dict[str, Any]:
    return {f.name: thaw(getattr(obj, f.name)) for f in fields(obj)}


def _check_keys(cls: type, data: Mapping[str, Any], where: str) -> None:
    if not isinstance(data, Mapping):
        raise TypeError(f"{where} must be a mapping, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    required = {
        f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
    }
    unknown = set(data) - known
    if unknown:
        raise ConfigFieldError(where, f"unknown keys {sorted(unknown)}; known: {sorted(known)}")
    missing = required - set(data)
    if missing:
        raise ConfigFieldError(where, f"missing keys {sorted(missing)}")


def _build(cls: type, data: Mapping[str, Any], where: str) -> Any:
    _check_keys(cls, data, where)
    kwargs = dict(data)
    if "layer_names" in kwargs and isinstance(kwargs["layer_names"], list):
        kwargs["layer_names"] = tuple(kwargs["layer_names"])
    return cls(**kwargs)
