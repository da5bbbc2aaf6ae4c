"""Engine-side inputs for JAX serving stacks, named as vLLM names them.

The attribute names are vLLM's (`tensor_parallel_size`, `cache_dtype`,
`kv_connector_extra_config`, ...), so `build_offloading_config` reads the same
attributes from these classes as vLLM's own function reads from a `VllmConfig`.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from jax_kvoffload.config import _validate as v
from jax_kvoffload.config._dtypes import as_dtype
from jax_kvoffload.config._errors import ConfigFieldError, ConfigTypeError
from jax_kvoffload.config._frozen import FrozenDict
from jax_kvoffload.config._kv_cache import KVCacheLayout

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
    """Parallel layout of this worker, with vLLM's validation and defaults.

    `world_size` defaults to PP x TP x PCP (x DP for the "external_launcher" backend) and
    the executor backend to "mp" when more than one process runs (counting DP) else
    "uni", as vLLM resolves them. `nnodes_within_dp` is given here (vLLM derives it).
    """

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
        v.int_fields(
            self,
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "prefill_context_parallel_size",
            "decode_context_parallel_size",
            "data_parallel_size",
            "nnodes_within_dp",
            "cp_kv_cache_interleave_size",
            minimum=1,
        )
        _check_dcp(
            self.tensor_parallel_size,
            self.prefill_context_parallel_size,
            self.decode_context_parallel_size,
        )
        if self.distributed_executor_backend is not None:
            v.str_fields(self, "distributed_executor_backend")
        if self.world_size is None:
            world = (
                self.pipeline_parallel_size
                * self.tensor_parallel_size
                * self.prefill_context_parallel_size
            )
            if self.distributed_executor_backend == "external_launcher":
                world *= self.data_parallel_size
            object.__setattr__(self, "world_size", world)
        v.int_fields(self, "world_size", minimum=1)
        if self.distributed_executor_backend is None:
            # vLLM: "mp" when the processes across DP are several, "uni" for one.
            several = cast(int, self.world_size) * self.data_parallel_size > 1
            object.__setattr__(self, "distributed_executor_backend", "mp" if several else "uni")
        backend = cast(str, self.distributed_executor_backend)
        # "class:<name>" stands for an Executor class passed to vLLM instead of a name.
        if backend not in EXECUTOR_BACKENDS and not backend.startswith("class:"):
            raise ConfigFieldError(
                "distributed_executor_backend",
                f"got {v.show(backend)}; use one of {EXECUTOR_BACKENDS} or 'class:<name>'",
            )
        v.int_fields(self, "rank", "data_parallel_index", minimum=0)
        if self.rank >= cast(int, self.world_size):
            raise ConfigFieldError(
                "rank",
                f"{self.rank} is not in [0, world_size={self.world_size}); "
                f"use 0..{cast(int, self.world_size) - 1}",
            )
        if self.data_parallel_index >= self.data_parallel_size:
            raise ConfigFieldError(
                "data_parallel_index",
                f"{self.data_parallel_index} is not in "
                f"[0, data_parallel_size={self.data_parallel_size}); "
                f"use 0..{self.data_parallel_size - 1}",
            )
        v.optional_int_fields(self, "data_parallel_rank_local", minimum=0)


def _check_dcp(tp: int, pcp: int, dcp: int) -> None:
    # vLLM's ParallelConfig._validate_parallel_config: without PCP, DCP reuses the TP
    # ranks (tp % dcp == 0); with PCP, DCP is off, spans PCP, or spans TP x PCP.
    if pcp == 1:
        if tp % dcp:
            valid = [d for d in range(1, tp + 1) if tp % d == 0]
            raise ConfigFieldError(
                "decode_context_parallel_size",
                f"tensor_parallel_size={tp} must be divisible by "
                f"decode_context_parallel_size={dcp} (vLLM's rule); use one of {valid}",
            )
    elif dcp not in (1, pcp, tp * pcp):
        raise ConfigFieldError(
            "decode_context_parallel_size",
            f"{dcp} with prefill_context_parallel_size={pcp} and tensor_parallel_size={tp}: "
            "with PCP, DCP must be disabled, span the PCP axis or span TP x PCP (vLLM's "
            f"rule); use one of {sorted({1, pcp, tp * pcp})}",
        )


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """What the translation reads of the model.

    `total_num_kv_heads` may be 0: attention-free models (and some hybrids) report 0,
    and the translation reads the count only on the paths that need it, as vLLM does.
    """

    model: str
    dtype: np.dtype
    total_num_kv_heads: int
    use_mla: bool = False
    max_model_len: int = 0

    def __post_init__(self) -> None:
        v.str_fields(self, "model")
        object.__setattr__(self, "dtype", as_dtype(self.dtype, "dtype"))
        v.int_fields(self, "total_num_kv_heads", "max_model_len", minimum=0)
        v.bool_fields(self, "use_mla")

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
    """Block size, cache dtype and prefix-caching settings of the engine.

    `kv_cache_layout` is copied into the `OffloadingConfig` as given, like vLLM's (a
    `KVCacheLayout` member is taken by its name); nothing here interprets it.
    """

    block_size: int = 16
    cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    prefix_match_unit: int | None = None
    kv_cache_layout: str | None = None

    def __post_init__(self) -> None:
        v.int_fields(self, "block_size", minimum=1)
        object.__setattr__(self, "cache_dtype", _cache_dtype_name(self.cache_dtype))
        v.bool_fields(self, "enable_prefix_caching")
        v.optional_int_fields(self, "prefix_match_unit", minimum=1)
        if isinstance(self.kv_cache_layout, KVCacheLayout):
            object.__setattr__(self, "kv_cache_layout", self.kv_cache_layout.name)
        v.optional_str_fields(self, "kv_cache_layout")


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
        v.str_fields(self, "kv_connector", "kv_role")
        extra = FrozenDict(self.kv_connector_extra_config, name="kv_connector_extra_config")
        object.__setattr__(self, "kv_connector_extra_config", extra)
        if self.engine_id is None:
            object.__setattr__(self, "engine_id", str(uuid.uuid4()))
        v.str_fields(self, "engine_id")


@dataclass(frozen=True, kw_only=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False

    def __post_init__(self) -> None:
        v.bool_fields(self, "enable_kv_cache_events")


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
        for name, cls, optional in (
            ("model_config", ModelConfig, False),
            ("cache_config", CacheConfig, False),
            ("parallel_config", ParallelConfig, False),
            ("kv_transfer_config", KVTransferConfig, True),
            ("kv_events_config", KVEventsConfig, True),
        ):
            value = getattr(self, name)
            if not isinstance(value, cls) and not (optional and value is None):
                none = " or None" if optional else ""
                raise ConfigTypeError(
                    name, f"must be a {cls.__name__}{none}, got {type(value).__name__}"
                )
        v.bool_fields(self, "use_v2_model_runner")
