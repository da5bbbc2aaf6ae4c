"""The offloading boundary: vLLM 0.33.0's `OffloadingConfig` and the rules that build it.

`build_offloading_config(engine_config, kv_cache_config)` applies vLLM's translation and
certification rules, in vLLM's order, to an engine description (`EngineConfig`) and a KV
cache description (`KVCacheConfig` with its spec classes). Every error derives from
`jax_kvoffload.errors.KVOffloadError`: an `OffloadConfigError` (a `ValueError`) where
vLLM raises `ValueError` or asserts, a `ConfigTypeError` (a `TypeError`) for a wrong
type. This package imports nothing else of ours.

This module exports what a user needs to describe an engine and configure offloading.
The translation's parts, the tier registry (`TierKind`; users reach it through
`jax_kvoffload.tiers`) and what our other packages need live in the semi-public
`jax_kvoffload.config.internals`; the canonical byte mappings in
`jax_kvoffload.config.canonical`.
"""

from jax_kvoffload.config._boundary import OffloadingCacheConfig as OffloadingCacheConfig
from jax_kvoffload.config._boundary import OffloadingConfig as OffloadingConfig
from jax_kvoffload.config._boundary import OffloadingGroupConfig as OffloadingGroupConfig
from jax_kvoffload.config._boundary import OffloadingModelConfig as OffloadingModelConfig
from jax_kvoffload.config._boundary import OffloadingParallelConfig as OffloadingParallelConfig
from jax_kvoffload.config._canonical_derive import CanonicalLayoutError as CanonicalLayoutError
from jax_kvoffload.config._canonical_derive import CanonicalRegistration as CanonicalRegistration
from jax_kvoffload.config._canonical_derive import (
    register_canonical_layout as register_canonical_layout,
)
from jax_kvoffload.config._engine import CacheConfig as CacheConfig
from jax_kvoffload.config._engine import EngineConfig as EngineConfig
from jax_kvoffload.config._engine import KVEventsConfig as KVEventsConfig
from jax_kvoffload.config._engine import KVTransferConfig as KVTransferConfig
from jax_kvoffload.config._engine import ModelConfig as ModelConfig
from jax_kvoffload.config._engine import ParallelConfig as ParallelConfig
from jax_kvoffload.config._errors import ChunkMultipleError as ChunkMultipleError
from jax_kvoffload.config._errors import ChunkSizeError as ChunkSizeError
from jax_kvoffload.config._errors import ChunkSizeOverflowError as ChunkSizeOverflowError
from jax_kvoffload.config._errors import ConfigFieldError as ConfigFieldError
from jax_kvoffload.config._errors import ConfigTypeError as ConfigTypeError
from jax_kvoffload.config._errors import MissingTransferConfigError as MissingTransferConfigError
from jax_kvoffload.config._errors import NoEligibleGroupsError as NoEligibleGroupsError
from jax_kvoffload.config._errors import NonUniformBlockSizeError as NonUniformBlockSizeError
from jax_kvoffload.config._errors import OffloadConfigError as OffloadConfigError
from jax_kvoffload.config._errors import PrefixMatchUnitError as PrefixMatchUnitError
from jax_kvoffload.config._errors import StateAlignmentError as StateAlignmentError
from jax_kvoffload.config._errors import TokensPerHashError as TokensPerHashError
from jax_kvoffload.config._errors import WindowSpecError as WindowSpecError
from jax_kvoffload.config._errors import ZeroChunkSizeError as ZeroChunkSizeError
from jax_kvoffload.config._host_tier import CACHE_LAYOUTS as CACHE_LAYOUTS
from jax_kvoffload.config._host_tier import HostTierConfig as HostTierConfig
from jax_kvoffload.config._host_tier import host_tier_config as host_tier_config
from jax_kvoffload.config._kv_cache import KVCacheConfig as KVCacheConfig
from jax_kvoffload.config._kv_cache import KVCacheGroupRole as KVCacheGroupRole
from jax_kvoffload.config._kv_cache import KVCacheGroupSpec as KVCacheGroupSpec
from jax_kvoffload.config._kv_cache import KVCacheLayout as KVCacheLayout
from jax_kvoffload.config._kv_cache import KVCacheTensor as KVCacheTensor
from jax_kvoffload.config._signature import check_arguments_of as _check_arguments_of
from jax_kvoffload.config._specs import AttentionSpec as AttentionSpec
from jax_kvoffload.config._specs import ChunkedLocalAttentionSpec as ChunkedLocalAttentionSpec
from jax_kvoffload.config._specs import CircularBufferSpec as CircularBufferSpec
from jax_kvoffload.config._specs import CrossAttentionSpec as CrossAttentionSpec
from jax_kvoffload.config._specs import EncoderOnlyAttentionSpec as EncoderOnlyAttentionSpec
from jax_kvoffload.config._specs import FullAttentionSpec as FullAttentionSpec
from jax_kvoffload.config._specs import HiddenStateCacheSpec as HiddenStateCacheSpec
from jax_kvoffload.config._specs import HiSparseHotSpec as HiSparseHotSpec
from jax_kvoffload.config._specs import HiSparseResidentSpec as HiSparseResidentSpec
from jax_kvoffload.config._specs import KVCacheSpec as KVCacheSpec
from jax_kvoffload.config._specs import KVQuantMode as KVQuantMode
from jax_kvoffload.config._specs import MambaSpec as MambaSpec
from jax_kvoffload.config._specs import MLAAttentionSpec as MLAAttentionSpec
from jax_kvoffload.config._specs import RSWASpec as RSWASpec
from jax_kvoffload.config._specs import SinkFullAttentionSpec as SinkFullAttentionSpec
from jax_kvoffload.config._specs import SlidingWindowMLASpec as SlidingWindowMLASpec
from jax_kvoffload.config._specs import SlidingWindowSpec as SlidingWindowSpec
from jax_kvoffload.config._specs import UniformTypeKVCacheSpecs as UniformTypeKVCacheSpecs
from jax_kvoffload.config._tier_disk import DiskTierConfig as DiskTierConfig
from jax_kvoffload.config._tier_mooncake import MooncakeTierConfig as MooncakeTierConfig
from jax_kvoffload.config._tier_options import VllmTierConfig as VllmTierConfig
from jax_kvoffload.config._tier_redis import RedisTierConfig as RedisTierConfig
from jax_kvoffload.config._tier_values import TierConfigError as TierConfigError
from jax_kvoffload.config._tiers import TierConfig as TierConfig
from jax_kvoffload.config._tiers import parse_secondary_tiers as parse_secondary_tiers
from jax_kvoffload.config._translate import build_offloading_config as build_offloading_config

# Grouped by what a user does with them, not sorted.
__all__ = [  # noqa: RUF022
    # building the boundary
    "build_offloading_config",
    "OffloadingConfig",
    "OffloadingGroupConfig",
    "OffloadingModelConfig",
    "OffloadingCacheConfig",
    "OffloadingParallelConfig",
    # the engine
    "EngineConfig",
    "ModelConfig",
    "CacheConfig",
    "ParallelConfig",
    "KVTransferConfig",
    "KVEventsConfig",
    # the KV cache
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheGroupRole",
    "KVCacheTensor",
    "KVCacheLayout",
    "KVCacheSpec",
    "AttentionSpec",
    "FullAttentionSpec",
    "MLAAttentionSpec",
    "HiddenStateCacheSpec",
    "SlidingWindowSpec",
    "SlidingWindowMLASpec",
    "ChunkedLocalAttentionSpec",
    "CircularBufferSpec",
    "EncoderOnlyAttentionSpec",
    "CrossAttentionSpec",
    "SinkFullAttentionSpec",
    "RSWASpec",
    "MambaSpec",
    "HiSparseHotSpec",
    "HiSparseResidentSpec",
    "UniformTypeKVCacheSpecs",
    "KVQuantMode",
    # the host tier's extra-config keys, parsed once (docs/tiers.md)
    "host_tier_config",
    "CACHE_LAYOUTS",
    "HostTierConfig",
    # secondary tiers (the `secondary_tiers` extra-config key, docs/tiers.md)
    "parse_secondary_tiers",
    "TierConfig",
    "DiskTierConfig",
    "RedisTierConfig",
    "MooncakeTierConfig",
    "VllmTierConfig",
    "TierConfigError",
    # canonical pages by hand (docs/canonical.md)
    "register_canonical_layout",
    "CanonicalRegistration",
    # errors
    "OffloadConfigError",
    "ConfigFieldError",
    "ConfigTypeError",
    "MissingTransferConfigError",
    "NoEligibleGroupsError",
    "PrefixMatchUnitError",
    "StateAlignmentError",
    "TokensPerHashError",
    "ChunkSizeError",
    "ChunkMultipleError",
    "NonUniformBlockSizeError",
    "ChunkSizeOverflowError",
    "ZeroChunkSizeError",
    "WindowSpecError",
    "CanonicalLayoutError",
]

# Public constructors refuse unknown keywords (a misspelt option) with a typed error.
_check_arguments_of(globals()[_name] for _name in __all__)
