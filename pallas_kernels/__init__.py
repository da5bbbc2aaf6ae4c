"""Pallas kernels that gather paged KV blocks into a staging buffer and scatter them back.

Standalone: nothing here imports jax_kvoffload. See docs/kernels.md.
"""

from .blocks.api import BACKENDS as BACKENDS
from .blocks.api import available_backends as available_backends
from .blocks.api import gather_blocks as gather_blocks
from .blocks.api import scatter_blocks as scatter_blocks
from .blocks.checks import check_block_ids as check_block_ids
from .blocks.errors import BackendUnavailableError as BackendUnavailableError
from .blocks.errors import BlockIdsDtypeError as BlockIdsDtypeError
from .blocks.errors import BlockIdsError as BlockIdsError
from .blocks.errors import BlockIdsOutOfRangeError as BlockIdsOutOfRangeError
from .blocks.errors import DuplicateBlockIdsError as DuplicateBlockIdsError
from .blocks.errors import LayerMismatchError as LayerMismatchError
from .blocks.errors import LayoutMismatchError as LayoutMismatchError
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
    "BackendUnavailableError",
    "BlockIdsDtypeError",
    "BlockIdsError",
    "BlockIdsOutOfRangeError",
    "DuplicateBlockIdsError",
    "KVLayout",
    "KVStacking",
    "LayerMismatchError",
    "LayoutMismatchError",
    "MosaicGpuConfig",
    "PageFormat",
    "StagingMismatchError",
    "TpuConfig",
    "TritonConfig",
    "UnsupportedDtypeError",
    "XlaConfig",
    "available_backends",
    "check_block_ids",
    "gather_blocks",
    "gather_blocks_reference",
    "scatter_blocks",
    "scatter_blocks_reference",
    "staging_sharding",
]
