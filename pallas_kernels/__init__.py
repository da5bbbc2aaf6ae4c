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
from .blocks.layout import KVLayout as KVLayout
from .blocks.layout import KVStacking as KVStacking
from .blocks.layout import PageFormat as PageFormat
from .blocks.mesh import staging_sharding as staging_sharding
from .blocks.mosaic_gpu import MosaicGpuConfig as MosaicGpuConfig
from .blocks.reference import gather_blocks_reference as gather_blocks_reference
from .blocks.reference import scatter_blocks_reference as scatter_blocks_reference
from .blocks.tpu import TpuConfig as TpuConfig
from .blocks.triton import TritonConfig as TritonConfig
from .blocks.xla import XlaConfig as XlaConfig

__all__ = [
    "BACKENDS",
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
    "StagingMismatchError",
    "TpuConfig",
    "TritonConfig",
    "UnsupportedDtypeError",
    "XlaConfig",
    "available_backends",
    "check_block_ids",
    "gather_blocks",
    "gather_blocks_reference",
    "get_backend",
    "list_backends",
    "scatter_blocks",
    "scatter_blocks_reference",
    "staging_sharding",
    "supported_backends",
]
