"""The KV cache description: tensors, groups and the whole config (vLLM 0.33.0's).

Mirrors `KVCacheTensor`, `KVCacheGroupSpec`, `KVCacheConfig` and `KVCacheLayout` from
`vllm/v1/kv_cache_interface.py` and `vllm/v1/kv_cache_layout.py`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from jax_kvoffload.config import _validate as v
from jax_kvoffload.config._errors import ConfigFieldError
from jax_kvoffload.config._specs import KVCacheSpec


class KVCacheLayout(enum.Enum):
    """Stride permutation of the logical axes [L, B, H, N, C] (layer, block, head, token,
    channel). vLLM's offloading connector requires LBHNC (BLHNC with HiSparse)."""

    LBHNC = (0, 1, 2, 3, 4)
    LBNHC = (0, 1, 3, 2, 4)
    LHBNC = (0, 2, 1, 3, 4)
    BLHNC = (1, 0, 2, 3, 4)
    BLNHC = (1, 0, 3, 2, 4)
    BHLNC = (1, 2, 0, 3, 4)


# Legacy names vLLM's CacheConfig still accepts.
_LEGACY_LAYOUTS = {"NHD": "LBNHC", "HND": "LBHNC"}


def layout_name(value: object, field: str = "kv_cache_layout") -> str | None:
    """A `KVCacheLayout` member name from a member, a name or a legacy alias; None stays."""
    if value is None:
        return None
    if isinstance(value, KVCacheLayout):
        return value.name
    name = getattr(value, "name", value)
    if isinstance(name, str):
        name = _LEGACY_LAYOUTS.get(name, name)
        if name in KVCacheLayout.__members__:
            return name
    raise ConfigFieldError(
        field,
        f"unknown layout {value!r}; use one of {sorted(KVCacheLayout.__members__)} "
        "or the legacy 'NHD' / 'HND'",
    )


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
        v.check_int("size", self.size, minimum=0)
        object.__setattr__(self, "layers", v.check_names("layers", self.layers))
        v.check_int("layer_stride", self.layer_stride, minimum=0)
        v.check_int("block_stride", self.block_stride, minimum=0)
        v.check_int("offset", self.offset, minimum=0)
        v.check_bool("host_resident", self.host_resident)


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
            raise TypeError(f"kv_cache_spec must be a KVCacheSpec, got {self.kv_cache_spec!r}")
        for name in ("is_eagle_group", "host_resident", "enable_kv_transfer"):
            v.check_bool(name, getattr(self, name))
        object.__setattr__(self, "role", KVCacheGroupRole(self.role))


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
        v.check_int("num_blocks", self.num_blocks, minimum=0)
        tensors = tuple(self.kv_cache_tensors)
        groups = tuple(self.kv_cache_groups)
        for t in tensors:
            if not isinstance(t, KVCacheTensor):
                raise TypeError(f"kv_cache_tensors[] must be KVCacheTensor, got {t!r}")
        for g in groups:
            if not isinstance(g, KVCacheGroupSpec):
                raise TypeError(f"kv_cache_groups[] must be KVCacheGroupSpec, got {g!r}")
        object.__setattr__(self, "kv_cache_tensors", tensors)
        object.__setattr__(self, "kv_cache_groups", groups)
        object.__setattr__(self, "kv_cache_layout", layout_name(self.kv_cache_layout))
        v.check_optional_int("hash_block_size", self.hash_block_size, minimum=1)
        v.check_optional_int("hisparse_host_num_blocks", self.hisparse_host_num_blocks, minimum=0)
        v.check_bool("hisparse_shared_host_pool", self.hisparse_shared_host_pool)
        v.check_int("kv_tp_replicas", self.kv_tp_replicas, minimum=1)

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
