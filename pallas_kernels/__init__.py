"""Pallas kernels that gather paged KV blocks into a staging buffer and scatter them back.

Standalone: nothing here imports jax_kvoffload. See docs/kernels.md.
"""

from .blocks.api import gather_blocks as gather_blocks
from .blocks.api import scatter_blocks as scatter_blocks
from .blocks.backends import BACKENDS as BACKENDS
from .blocks.backends import Backend as Backend
from .blocks.backends import available_backends as available_backends
from .blocks.backends import get_backend as get_backend
from .blocks.backends import list_backends as list_backends
from .blocks.backends import supported_backends as supported_backends
from .blocks.checks import check_block_ids as check_block_ids
from .blocks.errors import BackendConfigError as BackendConfigError
from .blocks.errors import BackendUnavailableError as BackendUnavailableError
from .blocks.errors import BlockIdsDtypeError as BlockIdsDtypeError
from .blocks.errors import BlockIdsError as BlockIdsError
from .blocks.errors import BlockIdsOutOfRangeError as BlockIdsOutOfRangeError
from .blocks.errors import CacheError as CacheError
from .blocks.errors import DuplicateBlockIdsError as DuplicateBlockIdsError
from .blocks.errors import LayerMismatchError as LayerMismatchError
from .blocks.errors import LayoutError as LayoutError
from .blocks.errors import LayoutMismatchError as LayoutMismatchError
from .blocks.errors import PallasKernelsError as PallasKernelsError
from .blocks.errors import StagingMismatchError as StagingMismatchError
from .blocks.errors import UnsupportedDtypeError as UnsupportedDtypeError
from .blocks.layout import LAYOUT_NAMES as LAYOUT_NAMES
from .blocks.layout import KVLayout as KVLayout
from .blocks.layout import KVStacking as KVStacking
from .blocks.layout import PageFormat as PageFormat
from .blocks.layout import named_layout as named_layout
from .blocks.mesh import staging_sharding as staging_sharding
from .blocks.mosaic_gpu import MosaicGpuConfig as MosaicGpuConfig
from .blocks.prepared import ScatterPlan as ScatterPlan
from .blocks.prepared import plan_scatter as plan_scatter
from .blocks.reference import gather_blocks_reference as gather_blocks_reference
from .blocks.reference import scatter_blocks_reference as scatter_blocks_reference
from .blocks.rpa import check_rpa_geometry as check_rpa_geometry
from .blocks.rpa import rpa_cache_shape as rpa_cache_shape
from .blocks.rpa import rpa_canonical as rpa_canonical
from .blocks.rpa import rpa_merge_canonical as rpa_merge_canonical
from .blocks.rpa import rpa_needs_merge as rpa_needs_merge
from .blocks.rpa import rpa_pack as rpa_pack
from .blocks.rpa import rpa_packing as rpa_packing
from .blocks.rpa import rpa_shards as rpa_shards
from .blocks.rpa import rpa_slots_per_shard as rpa_slots_per_shard
from .blocks.rpa import rpa_unpack as rpa_unpack
from .blocks.tpu import TpuConfig as TpuConfig
from .blocks.triton import TritonConfig as TritonConfig
from .blocks.xla import XlaConfig as XlaConfig

__all__ = [
    "BACKENDS",
    "LAYOUT_NAMES",
    "Backend",
    "BackendConfigError",
    "BackendUnavailableError",
    "BlockIdsDtypeError",
    "BlockIdsError",
    "BlockIdsOutOfRangeError",
    "CacheError",
    "DuplicateBlockIdsError",
    "KVLayout",
    "KVStacking",
    "LayerMismatchError",
    "LayoutError",
    "LayoutMismatchError",
    "MosaicGpuConfig",
    "PageFormat",
    "PallasKernelsError",
    "ScatterPlan",
    "StagingMismatchError",
    "TpuConfig",
    "TritonConfig",
    "UnsupportedDtypeError",
    "XlaConfig",
    "available_backends",
    "check_block_ids",
    "check_rpa_geometry",
    "gather_blocks",
    "gather_blocks_reference",
    "get_backend",
    "list_backends",
    "named_layout",
    "plan_scatter",
    "rpa_cache_shape",
    "rpa_canonical",
    "rpa_merge_canonical",
    "rpa_needs_merge",
    "rpa_pack",
    "rpa_packing",
    "rpa_shards",
    "rpa_slots_per_shard",
    "rpa_unpack",
    "scatter_blocks",
    "scatter_blocks_reference",
    "staging_sharding",
    "supported_backends",
]
