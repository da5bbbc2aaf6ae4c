"""Engine-side inputs for JAX serving stacks, named as vLLM names them.

The attribute names are vLLM's (`tensor_parallel_size`, `cache_dtype`,
`kv_connector_extra_config`, ...), so `build_offloading_config` reads the same
attributes from these classes as vLLM's own function reads from a `VllmConfig`.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jax_kvoffload.config import _validate as v
from jax_kvoffload.config._dtypes import as_dtype
from jax_kvoffload.config._errors import ConfigFieldError
from jax_kvoffload.config._frozen import FrozenDict
from jax_kvoffload.config._kv_cache import layout_name

EXECUTOR_BACKENDS = ("mp", "uni", "ray", "external_launcher")

# vLLM 0.33.0's `CacheDType` names that are not plain dtypes (config/cache.py).
_QUANT_CACHE_DTYPES = frozenset(
    {
        "fp8",
        "fp8_e4m3",
        "fp8_e5m2",
        "fp8_inc",
        "fp8_ds_mla",
        "nvfp4_ds_mla",
        "nvfp4",
        "nvfp4_4over6",
        "ultraquant_4bit",
        "int8_per_token_head",
        "fp8_per_token_head",
        "int4_per_token_head",
    }
)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Parallel layout of this worker. `world_size` defaults to PP x TP x PCP and the
    executor backend to "mp" when world_size > 1 else "uni", as vLLM resolves them."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_index: int = 0
    data_parallel_rank_local: int | None = None
    rank: int = 0
    world_size: int | None = None
    distributed_executor_backend: str | None = None
    nnodes_within_dp: int = 1
    cp_kv_cache_interleave_size: int = 1

    def __post_init__(self) -> None:
        for name in (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "prefill_context_parallel_size",
            "decode_context_parallel_size",
            "data_parallel_size",
            "nnodes_within_dp",
            "cp_kv_cache_interleave_size",
        ):
            v.check_int(name, getattr(self, name), minimum=1)
        if self.tensor_parallel_size % self.decode_context_parallel_size:
            raise ConfigFieldError(
                "decode_context_parallel_size",
                f"tensor_parallel_size={self.tensor_parallel_size} must be divisible by "
                f"decode_context_parallel_size={self.decode_context_parallel_size} (vLLM's rule)",
            )
        if self.world_size is None:
            world = (
                self.pipeline_parallel_size
                * self.tensor_parallel_size
                * self.prefill_context_parallel_size
            )
            object.__setattr__(self, "world_size", world)
        v.check_int("world_size", self.world_size, minimum=1)
        if self.distributed_executor_backend is None:
            backend = "mp" if self.world_size > 1 else "uni"
            object.__setattr__(self, "distributed_executor_backend", backend)
        backend = self.distributed_executor_backend
        # "class:<name>" stands for an Executor class passed to vLLM instead of a name.
        if backend not in EXECUTOR_BACKENDS and not str(backend).startswith("class:"):
            raise ConfigFieldError(
                "distributed_executor_backend",
                f"must be one of {EXECUTOR_BACKENDS} or 'class:<name>', got {backend!r}",
            )
        v.check_int("rank", self.rank, minimum=0)
        if self.rank >= self.world_size:
            raise ConfigFieldError(
                "rank", f"{self.rank} is not in [0, world_size={self.world_size})"
            )
        v.check_int("data_parallel_index", self.data_parallel_index, minimum=0)
        if self.data_parallel_index >= self.data_parallel_size:
            raise ConfigFieldError(
                "data_parallel_index",
                f"{self.data_parallel_index} is not in "
                f"[0, data_parallel_size={self.data_parallel_size})",
            )
        v.check_optional_int("data_parallel_rank_local", self.data_parallel_rank_local, minimum=0)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What the translation reads of the model."""

    model: str
    dtype: np.dtype
    total_num_kv_heads: int
    use_mla: bool = False
    max_model_len: int = 0

    def __post_init__(self) -> None:
        v.check_str("model", self.model)
        object.__setattr__(self, "dtype", as_dtype(self.dtype, "dtype"))
        v.check_int("total_num_kv_heads", self.total_num_kv_heads, minimum=1)
        v.check_bool("use_mla", self.use_mla)
        v.check_int("max_model_len", self.max_model_len, minimum=0)

    def get_total_num_kv_heads(self) -> int:
        return self.total_num_kv_heads


def _cache_dtype_name(value: object) -> str:
    if isinstance(value, str) and (
        value == "auto"
        or value in _QUANT_CACHE_DTYPES
        or value.startswith(("turboquant_", "octave_"))
    ):
        return value
    return str(as_dtype(value, "cache_dtype"))


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """Block size, cache dtype and prefix-caching settings of the engine."""

    block_size: int = 16
    cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    prefix_match_unit: int | None = None
    kv_cache_layout: str | None = None

    def __post_init__(self) -> None:
        v.check_int("block_size", self.block_size, minimum=1)
        object.__setattr__(self, "cache_dtype", _cache_dtype_name(self.cache_dtype))
        v.check_bool("enable_prefix_caching", self.enable_prefix_caching)
        v.check_optional_int("prefix_match_unit", self.prefix_match_unit, minimum=1)
        object.__setattr__(self, "kv_cache_layout", layout_name(self.kv_cache_layout))


@dataclass(frozen=True, kw_only=True)
class KVTransferConfig:
    """The connector settings; `kv_connector_extra_config` is parsed by the translation.

    As in vLLM, a missing `engine_id` becomes a fresh uuid4 string.
    """

    kv_connector: str = "OffloadingConnector"
    kv_role: str = "kv_both"
    kv_connector_extra_config: Mapping[str, Any] = field(default_factory=FrozenDict)
    engine_id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector_extra_config, Mapping):
            raise TypeError(
                "kv_connector_extra_config must be a mapping, got "
                f"{type(self.kv_connector_extra_config).__name__}"
            )
        extra = FrozenDict(self.kv_connector_extra_config)
        object.__setattr__(self, "kv_connector_extra_config", extra)
        if self.engine_id is None:
            object.__setattr__(self, "engine_id", str(uuid.uuid4()))
        v.check_str("engine_id", self.engine_id)


@dataclass(frozen=True, kw_only=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Everything `build_offloading_config` reads besides the KV cache config."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    kv_transfer_config: KVTransferConfig | None = None
    kv_events_config: KVEventsConfig | None = None
    use_v2_model_runner: bool = False

    def __post_init__(self) -> None:
        for name, cls in (
            ("model_config", ModelConfig),
            ("cache_config", CacheConfig),
            ("parallel_config", ParallelConfig),
        ):
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"{name} must be a {cls.__name__}, got {getattr(self, name)!r}")
        v.check_bool("use_v2_model_runner", self.use_v2_model_runner)
