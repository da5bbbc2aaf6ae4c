"""The normalized offloading boundary: vLLM 0.33.0's `vllm/v1/kv_offload/config.py`.

Same classes, same fields in the same order, same defaults (spec section 1). Differences,
all in favour of use as JAX statics: fields are validated (types, and the sizes no engine
runs with), and `extra_config` is a `FrozenDict` holding a private copy of the caller's
mapping (vLLM holds the caller's dict itself), so every config is hashable while reads
still return the lists and dicts vLLM's consumers check for; `to_dict()` / `from_dict()`
give a JSON round trip.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

from jax_kvoffload.config import _validate as v
from jax_kvoffload.config._errors import ConfigFieldError, ConfigTypeError
from jax_kvoffload.config._frozen import FrozenDict, thaw

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_T = TypeVar("_T")


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
        v.int_fields(self, "tokens_per_block", minimum=1, bounded=False)
        object.__setattr__(self, "layer_names", v.check_names("layer_names", self.layer_names))
        v.int_fields(self, "group_id", minimum=0, bounded=False)
        v.optional_int_fields(self, "sliding_window_size_in_chunks", minimum=0, bounded=False)


@dataclass(frozen=True)
class OffloadingModelConfig:
    """Model identity. `dtype` is the KV cache dtype string, e.g. "bfloat16" or "fp8"."""

    name: str
    dtype: str
    max_model_len: int = 0

    def __post_init__(self) -> None:
        v.str_fields(self, "name", "dtype")
        v.int_fields(self, "max_model_len", minimum=0, bounded=False)


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
        v.int_fields(self, "tokens_per_hash", minimum=1, bounded=False)
        v.int_fields(self, "blocks_per_chunk", minimum=0, bounded=False)


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
        # >= 0, not >= 1: vLLM's own test doubles build scheduler configs with no workers.
        sizes = ("world_size", "tp_size", "pp_size", "pcp_size", "dcp_size", "data_parallel_size")
        v.int_fields(self, "rank", "data_parallel_index", *sizes, minimum=0, bounded=False)
        v.optional_int_fields(self, "data_parallel_rank_local", minimum=0, bounded=False)
        v.bool_fields(self, "is_parallelism_agnostic")


@dataclass(frozen=True)
class OffloadingConfig:
    """The whole boundary: what the host store and the transfer engine are built from.

    Attributes:
      groups: the offloaded groups, in selection order.
      worker_kv_bytes_per_block: KV bytes one worker stores per block (all groups).
      enable_kv_cache_events: whether KV cache events are enabled.
      extra_config: the connector's `kv_connector_extra_config`: a `FrozenDict` copy;
        every read returns fresh lists/dicts as the caller wrote them.
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
        if isinstance(self.groups, (str, set, frozenset)) or not isinstance(self.groups, Iterable):
            kind = type(self.groups).__name__
            raise ConfigTypeError("groups", f"must be a tuple of OffloadingGroupConfig, got {kind}")
        groups = tuple(self.groups)
        for i, g in enumerate(groups):
            _check_type(f"groups[{i}]", g, OffloadingGroupConfig)
        object.__setattr__(self, "groups", groups)
        v.int_fields(self, "worker_kv_bytes_per_block", minimum=0, bounded=False)
        v.bool_fields(self, "enable_kv_cache_events", "replicated_layout", "canonical_layout")
        object.__setattr__(self, "extra_config", FrozenDict(self.extra_config))
        v.str_fields(self, "engine_id")
        _check_type("model", self.model, OffloadingModelConfig)
        _check_type("cache", self.cache, OffloadingCacheConfig)
        _check_type("parallel", self.parallel, OffloadingParallelConfig)
        v.optional_str_fields(self, "kv_cache_layout")

    def with_layout_as_given(self, kv_cache_layout: object) -> OffloadingConfig:
        """This config with `kv_cache_layout` set to vLLM's value as it is, unchecked.

        vLLM copies `cache_config.kv_cache_layout` into its config without looking at
        it, so its scheduler and config tests pass test doubles there; the vLLM adapter
        does the same through this (our own constructors check the type). Our data path
        reads the layout only for canonical pages, which name a `KVCacheLayout` first.
        """
        if kv_cache_layout is None or isinstance(kv_cache_layout, str):
            return dataclasses.replace(self, kv_cache_layout=kv_cache_layout)
        out = dataclasses.replace(self, kv_cache_layout=None)
        object.__setattr__(out, "kv_cache_layout", kv_cache_layout)
        return out

    def to_dict(self) -> dict[str, object]:
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
        # `data` stays Any-valued: its values go to the constructors, which check each.
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


def _check_type(field: str, value: object, cls: type) -> None:
    if not isinstance(value, cls):
        raise ConfigTypeError(field, f"must be a {cls.__name__}, got {type(value).__name__}")


def _plain(obj: DataclassInstance) -> dict[str, object]:
    return {f.name: thaw(getattr(obj, f.name)) for f in fields(obj)}


def _check_keys(cls: type, data: object, where: str) -> None:
    if not isinstance(data, Mapping):
        raise ConfigTypeError(where, f"must be a mapping (a dict), got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    required = {
        f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
    }
    unknown = set(data) - known
    if unknown:
        raise ConfigFieldError(
            where, f"unknown keys {sorted(map(str, unknown))}; use only {sorted(known)}"
        )
    missing = required - set(data)
    if missing:
        raise ConfigFieldError(where, f"missing keys {sorted(missing)}; add them")


def _build(cls: type[_T], data: Mapping[str, Any], where: str) -> _T:
    _check_keys(cls, data, where)
    kwargs = dict(data)
    if "layer_names" in kwargs and isinstance(kwargs["layer_names"], list):
        kwargs["layer_names"] = tuple(kwargs["layer_names"])
    return cls(**kwargs)
