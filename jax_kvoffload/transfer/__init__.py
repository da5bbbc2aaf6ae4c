"""Worker side: move KV blocks between device caches and pre-allocated host memory.

`TransferEngine` runs the gather/scatter kernels of `pallas_kernels` and `jax.device_put`
asynchronously over a `HostChunkPool`. See docs/architecture.md.
"""

from jax_kvoffload.transfer._buckets import bucket_sizes as bucket_sizes
from jax_kvoffload.transfer._caches import GroupCaches as GroupCaches
from jax_kvoffload.transfer._canonical import CanonicalGroupPlan as CanonicalGroupPlan
from jax_kvoffload.transfer._canonical import canonical_block_bytes as canonical_block_bytes
from jax_kvoffload.transfer._canonical import group_layer_pages as group_layer_pages
from jax_kvoffload.transfer._canonical import layer_view as layer_view
from jax_kvoffload.transfer._canonical import plan_for_group as plan_for_group
from jax_kvoffload.transfer._canonical import plan_for_padded_page as plan_for_padded_page
from jax_kvoffload.transfer._canonical_global import check_global_caches as check_global_caches
from jax_kvoffload.transfer._canonical_pool import CanonicalPoolView as CanonicalPoolView
from jax_kvoffload.transfer._canonical_pool import plans_for_rank as plans_for_rank
from jax_kvoffload.transfer._engine import TransferEngine as TransferEngine
from jax_kvoffload.transfer._errors import TransferError as TransferError
from jax_kvoffload.transfer._errors import TransferStateError as TransferStateError
from jax_kvoffload.transfer._host_pool import HostChunkPool as HostChunkPool
from jax_kvoffload.transfer._job_types import Direction as Direction
from jax_kvoffload.transfer._job_types import GroupTransfer as GroupTransfer
from jax_kvoffload.transfer._job_types import TransferResult as TransferResult
from jax_kvoffload.transfer._medium import Medium as Medium
from jax_kvoffload.transfer._medium import TransferPath as TransferPath
from jax_kvoffload.transfer._pinned_pool import PinnedRowPool as PinnedRowPool
from jax_kvoffload.transfer._pool_base import HostPool as HostPool
from jax_kvoffload.transfer._pool_base import HostPoolError as HostPoolError
from jax_kvoffload.transfer._row_pool import ChunkRowPool as ChunkRowPool
from jax_kvoffload.transfer._shared_region import SharedHostRegion as SharedHostRegion
from jax_kvoffload.transfer._shared_region import SharedRegionError as SharedRegionError

__all__ = [
    "CanonicalGroupPlan",
    "CanonicalPoolView",
    "ChunkRowPool",
    "Direction",
    "GroupCaches",
    "GroupTransfer",
    "HostChunkPool",
    "HostPool",
    "HostPoolError",
    "Medium",
    "PinnedRowPool",
    "SharedHostRegion",
    "SharedRegionError",
    "TransferEngine",
    "TransferError",
    "TransferPath",
    "TransferResult",
    "TransferStateError",
    "bucket_sizes",
    "canonical_block_bytes",
    "check_global_caches",
    "group_layer_pages",
    "layer_view",
    "plan_for_group",
    "plan_for_padded_page",
    "plans_for_rank",
]
