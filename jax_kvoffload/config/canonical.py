"""The canonical page layout's byte mappings: semi-public, for this library's packages.

`jax_kvoffload.transfer` and `jax_kvoffload.bridge` build their relayouts from these
(`CopyRun`, `CanonicalPageMapping`, `KVTensorView`, ...), tests and benchmarks probe the
per-layer derivation. A user who certifies a layout by hand needs only
`register_canonical_layout` / `CanonicalRegistration` / `CanonicalLayoutError`, which
`jax_kvoffload.config` exports (docs/canonical.md). Names here are stable within a
release and documented in docs/canonical.md; they are not part of the user API.
"""

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

__all__ = [
    "CANONICAL_FORMAT_VERSION",
    "ByteRegion",
    "CanonicalLayoutError",
    "CanonicalPageMapping",
    "CanonicalRegistration",
    "CanonicalTilingError",
    "CopyRun",
    "KVTensorView",
    "LayerCanonicalMappings",
    "RankContext",
    "canonical_format_id",
    "coalesce_runs",
    "derive_canonical_mappings",
    "derive_layer_mappings",
    "interleave_tokens",
    "layer_mapping",
    "layer_mapping_or_reason",
    "opaque_fallback_mapping",
    "rank_contexts",
    "register_canonical_layout",
    "verify_tiling",
]
