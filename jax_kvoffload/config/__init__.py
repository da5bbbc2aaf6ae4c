"""The offloading boundary: vLLM 0.33.0's `OffloadingConfig` and the rules that build it.

`build_offloading_config(engine_config, kv_cache_config)` applies vLLM's translation and
certification rules, in vLLM's order, to an engine description (`EngineConfig`) and a KV
cache description (`KVCacheConfig` with its spec classes). Every error is a typed
`OffloadConfigError`, a `ValueError`. This package imports nothing else of ours.
"""

from jax_kvoffload.config._block_sizes import (
    resolve_dcp_kv_block_size as resolve_dcp_kv_block_size,
)
from jax_kvoffload.config._block_sizes import (
    resolve_kv_cache_block_sizes as resolve_kv_cache_block_sizes,
)
from jax_kvoffload.config._boundary import OffloadingCacheConfig as OffloadingCacheConfig
from jax_kvoffload.config._boundary import OffloadingConfig as OffloadingConfig
from jax_kvoffload.config._boundary import OffloadingGroupConfig as OffloadingGroupConfig
from jax_kvoffload.config._boundary import OffloadingModelConfig as OffloadingModelConfig
from jax_kvoffload.config._boundary import OffloadingParallelConfig as OffloadingParallelConfig
from jax_kvoffload.config._canonical import ByteRegion as ByteRegion
from jax_kvoffload.config._canonical import CanonicalPageMapping as CanonicalPageMapping
from jax_kvoffload.config._canonical import CopyRun as CopyRun
from jax_kvoffload.config._canonical import KVTensorView as KVTensorView
from jax_kvoffload.config._canonical import RankContext as RankContext
from jax_kvoffload.config._canonical import coalesce_runs as coalesce_runs
from jax_kvoffload.config._canonical import interleave_tokens as interleave_tokens
from jax_kvoffload.config._canonical_derive import CanonicalLayoutError as CanonicalLayoutError
from jax_kvoffload.config._canonical_derive import CanonicalRegistration as CanonicalRegistration
from jax_kvoffload.config._canonical_derive import LayerCanonicalMappings as LayerCanonicalMappings
from jax_kvoffload.config._canonical_derive import (
    derive_canonical_mappings as derive_canonical_mappings,
)
from jax_kvoffload.config._canonical_derive import derive_layer_mappings as derive_layer_mappings
from jax_kvoffload.config._canonical_derive import rank_contexts as rank_contexts
from jax_kvoffload.config._canonical_derive import (
    register_canonical_layout as register_canonical_layout,
)
from jax_kvoffload.config._canonical_layer import (
    CANONICAL_FORMAT_VERSION as CANONICAL_FORMAT_VERSION,
)
from jax_kvoffload.config._canonical_layer import CanonicalTilingError as CanonicalTilingError
from jax_kvoffload.config._canonical_layer import canonical_format_id as canonical_format_id
from jax_kvoffload.config._canonical_layer import layer_mapping as layer_mapping
from jax_kvoffload.config._canonical_layer import layer_mapping_or_reason as layer_mapping_or_reason
from jax_kvoffload.config._canonical_layer import opaque_fallback_mapping as opaque_fallback_mapping
from jax_kvoffload.config._canonical_layer import verify_tiling as verify_tiling
from jax_kvoffload.config._dtypes import as_dtype as as_dtype
from jax_kvoffload.config._engine import CacheConfig as CacheConfig
from jax_kvoffload.config._engine import EngineConfig as EngineConfig
from jax_kvoffload.config._engine import KVEventsConfig as KVEventsConfig
from jax_kvoffload.config._engine import KVTransferConfig as KVTransferConfig
from jax_kvoffload.config._engine import ModelConfig as ModelConfig
from jax_kvoffload.config._engine import ParallelConfig as ParallelConfig
from jax_kvoffload.config._errors import ChunkMultipleError as ChunkMultipleError
from jax_kvoffload.config._errors import ChunkSizeError as ChunkSizeError
from jax_kvoffload.config._errors import ConfigFieldError as ConfigFieldError
from jax_kvoffload.config._errors import MissingTransferConfigError as MissingTransferConfigError
from jax_kvoffload.config._errors import NoEligibleGroupsError as NoEligibleGroupsError
from jax_kvoffload.config._errors import NonUniformBlockSizeError as NonUniformBlockSizeError
from jax_kvoffload.config._errors import OffloadConfigError as OffloadConfigError
from jax_kvoffload.config._errors import PrefixMatchUnitError as PrefixMatchUnitError
from jax_kvoffload.config._errors import StateAlignmentError as StateAlignmentError
from jax_kvoffload.config._errors import TokensPerHashError as TokensPerHashError
from jax_kvoffload.config._errors import WindowSpecError as WindowSpecError
from jax_kvoffload.config._frozen import FrozenDict as FrozenDict
from jax_kvoffload.config._gates import spec_certifiable as spec_certifiable
from jax_kvoffload.config._kv_cache import KVCacheConfig as KVCacheConfig
from jax_kvoffload.config._kv_cache import KVCacheGroupRole as KVCacheGroupRole
from jax_kvoffload.config._kv_cache import KVCacheGroupSpec as KVCacheGroupSpec
from jax_kvoffload.config._kv_cache import KVCacheLayout as KVCacheLayout
from jax_kvoffload.config._kv_cache import KVCacheTensor as KVCacheTensor
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
from jax_kvoffload.config._specs import iter_layer_specs as iter_layer_specs
from jax_kvoffload.config._specs import kv_quant_mode_for as kv_quant_mode_for
from jax_kvoffload.config._translate import Certification as Certification
from jax_kvoffload.config._translate import build_offloading_config as build_offloading_config
from jax_kvoffload.config._translate import certify as certify
from jax_kvoffload.config._translate import get_offloading_group_ids as get_offloading_group_ids
from jax_kvoffload.config._translate import (
    get_sliding_window_size_in_chunks as get_sliding_window_size_in_chunks,
)
from jax_kvoffload.config._translate import group_kv_bytes_per_block as group_kv_bytes_per_block

__all__ = [
    "CANONICAL_FORMAT_VERSION",
    "AttentionSpec",
    "ByteRegion",
    "CacheConfig",
    "CanonicalLayoutError",
    "CanonicalPageMapping",
    "CanonicalRegistration",
    "CanonicalTilingError",
    "Certification",
    "ChunkMultipleError",
    "ChunkSizeError",
    "ChunkedLocalAttentionSpec",
    "CircularBufferSpec",
    "ConfigFieldError",
    "CopyRun",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "EngineConfig",
    "FrozenDict",
    "FullAttentionSpec",
    "HiSparseHotSpec",
    "HiSparseResidentSpec",
    "HiddenStateCacheSpec",
    "KVCacheConfig",
    "KVCacheGroupRole",
    "KVCacheGroupSpec",
    "KVCacheLayout",
    "KVCacheSpec",
    "KVCacheTensor",
    "KVEventsConfig",
    "KVQuantMode",
    "KVTensorView",
    "KVTransferConfig",
    "LayerCanonicalMappings",
    "MLAAttentionSpec",
    "MambaSpec",
    "MissingTransferConfigError",
    "ModelConfig",
    "NoEligibleGroupsError",
    "NonUniformBlockSizeError",
    "OffloadConfigError",
    "OffloadingCacheConfig",
    "OffloadingConfig",
    "OffloadingGroupConfig",
    "OffloadingModelConfig",
    "OffloadingParallelConfig",
    "ParallelConfig",
    "PrefixMatchUnitError",
    "RSWASpec",
    "RankContext",
    "SinkFullAttentionSpec",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "StateAlignmentError",
    "TokensPerHashError",
    "UniformTypeKVCacheSpecs",
    "WindowSpecError",
    "as_dtype",
    "build_offloading_config",
    "canonical_format_id",
    "certify",
    "coalesce_runs",
    "derive_canonical_mappings",
    "derive_layer_mappings",
    "get_offloading_group_ids",
    "get_sliding_window_size_in_chunks",
    "group_kv_bytes_per_block",
    "interleave_tokens",
    "iter_layer_specs",
    "kv_quant_mode_for",
    "layer_mapping",
    "layer_mapping_or_reason",
    "opaque_fallback_mapping",
    "rank_contexts",
    "register_canonical_layout",
    "resolve_dcp_kv_block_size",
    "resolve_kv_cache_block_sizes",
    "spec_certifiable",
    "verify_tiling",
]
