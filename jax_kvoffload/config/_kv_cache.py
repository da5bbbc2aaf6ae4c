"""The KV cache description: tensors, groups and the whole config (vLLM 0.33.0's).

Mirrors `KVCacheTensor`, `KVCacheGroupSpec`, `KVCacheConfig` and `KVCacheLayout` from
`vllm/v1/kv_cache_interface.py` and `vllm/v1/kv_cache_layout.py`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from jax_kvoffload.config import _validate as v
from jax_kvoffload.config._errors import ConfigFieldError, ConfigTypeError
from jax_kvoffload.config._specs import KVCacheSpec

_T = TypeVar("_T")


class KVCacheLayout(enum.Enum):
    """Stride permutation of the logical axes [L, B, H, N, C] (layer, block, head, token,
    channel). vLLM's offloading connector requires LBHNC (BLHNC with HiSparse)."""

    LBHNC = (0, 1, 2, 3, 4)
    LBNHC = (0, 1, 3, 2, 4)
    LHBNC = (0, 2, 1, 3, 4)
    BLHNC = (1, 0, 2, 3, 4)
    BLNHC = (1, 0, 3, 2, 4)
    BHLNC = (1, 2, 0, 3, 4)


def layout_name(value: object, field: str = "kv_cache_layout") -> str | None:
    """A layout as the config keeps it: None, a str as given (vLLM copies it through
    without interpreting it), or a `KVCacheLayout` member's name."""
    if isinstance(value, KVCacheLayout):
        return value.name
    return v.check_optional_str(field, value)


def _items(field: str, value: object, cls: type[_T]) -> tuple[_T, ...]:
    if isinstance(value, (str, set, frozenset, Mapping)) or not isinstance(value, Iterable):
        raise ConfigTypeError(
            field,
            f"must be a list or tuple of {cls.__name__}, got {type(value).__name__}; pass "
            "() for none",
        )
    items = tuple(value)
    for i, item in enumerate(items):
        if not isinstance(item, cls):
            raise ConfigTypeError(
                f"{field}[{i}]", f"must be a {cls.__name__}, got {type(item).__name__}"
            )
    return items


class KVCacheGroupRole(str, enum.Enum):
    DEFAULT = "default"
    HISPARSE_SOURCE = "hisparse_source"
    HISPARSE_INDEXER = "hisparse_indexer"


@dataclass(frozen=True, kw_only=True)
class KVCacheTensor:
    """Placement of layers inside one backing allocation.

    `size` is the total bytes of that allocation, not a per-tensor share. Layer l's page
    of block b starts at `offset + l * layer_stride + b * block_stride`.
    """

    size: int
    layers: tuple[str, ...]
    layer_stride: int
    block_stride: int
    offset: int = 0
    host_resident: bool = False

    def __post_init__(self) -> None:
        v.int_fields(self, "size", "layer_stride", "block_stride", "offset", minimum=0)
        object.__setattr__(self, "layers", v.check_names("layers", self.layers))
        v.bool_fields(self, "host_resident")


@dataclass(frozen=True, kw_only=True)
class KVCacheGroupSpec:
    """Layers sharing one block table and one spec."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False
    host_resident: bool = False
    enable_kv_transfer: bool = True
    role: KVCacheGroupRole = KVCacheGroupRole.DEFAULT

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_names", v.check_names("layer_names", self.layer_names))
        if not isinstance(self.kv_cache_spec, KVCacheSpec):
            raise ConfigTypeError(
                "kv_cache_spec",
                f"must be a KVCacheSpec (e.g. FullAttentionSpec), got "
                f"{type(self.kv_cache_spec).__name__}",
            )
        v.bool_fields(self, "is_eagle_group", "host_resident", "enable_kv_transfer")
        try:
            object.__setattr__(self, "role", KVCacheGroupRole(self.role))
        except ValueError:
            roles = [r.value for r in KVCacheGroupRole]
            raise ConfigFieldError("role", f"got {v.show(self.role)}; use one of {roles}") from None


@dataclass(frozen=True, kw_only=True)
class KVCacheConfig:
    """The engine's KV cache: blocks, backing tensors and groups."""

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    prefix_cache_retention_interval: int | None = None
    kv_cache_layout: str | None = None
    hash_block_size: int | None = None
    cache_hit_alignment_tokens: int | None = None
    hisparse_host_num_blocks: int | None = None
    hisparse_host_block_stride: int | None = None
    hisparse_shared_host_pool: bool = False
    kv_tp_replicas: int = 1
    """Consecutive TP ranks holding identical KV for every layer."""

    def __post_init__(self) -> None:
        v.int_fields(self, "num_blocks", minimum=0)
        tensors = _items("kv_cache_tensors", self.kv_cache_tensors, KVCacheTensor)
        groups = _items("kv_cache_groups", self.kv_cache_groups, KVCacheGroupSpec)
        object.__setattr__(self, "kv_cache_tensors", tensors)
        object.__setattr__(self, "kv_cache_groups", groups)
        object.__setattr__(self, "kv_cache_layout", layout_name(self.kv_cache_layout))
        v.optional_int_fields(
            self,
            "prefix_cache_retention_interval",
            "hash_block_size",
            "cache_hit_alignment_tokens",
            minimum=1,
        )
        v.optional_int_fields(
            self, "hisparse_host_num_blocks", "hisparse_host_block_stride", minimum=0
        )
        v.bool_fields(self, "hisparse_shared_host_pool")
        v.int_fields(self, "kv_tp_replicas", minimum=1)

    @property
    def transfer_group_ids(self) -> tuple[int, ...]:
        return tuple(i for i, g in enumerate(self.kv_cache_groups) if g.enable_kv_transfer)

    @property
    def prefix_cacheable_group_ids(self) -> tuple[int, ...]:
        return tuple(
            i
            for i in self.transfer_group_ids
            if self.kv_cache_groups[i].kv_cache_spec.prefix_cacheable
        )
