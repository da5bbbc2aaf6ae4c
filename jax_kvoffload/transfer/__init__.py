"""Worker side: move KV blocks between device caches and pre-allocated host memory.

`TransferEngine` runs the gather/scatter kernels of `pallas_kernels` and `jax.device_put`
asynchronously over a host pool (`jax_kvoffload.hostmem.HostPool`, e.g. `HostChunkPool`).
See docs/architecture.md.
"""

from jax_kvoffload.transfer._buckets import bucket_sizes as bucket_sizes
from jax_kvoffload.transfer._caches import GroupCaches as GroupCaches
from jax_kvoffload.transfer._canonical import CanonicalGroupPlan as CanonicalGroupPlan
from jax_kvoffload.transfer._canonical import canonical_block_bytes as canonical_block_bytes
from jax_kvoffload.transfer._canonical import group_layer_pages as group_layer_pages
from jax_kvoffload.transfer._canonical import layer_view as layer_view
from jax_kvoffload.transfer._canonical import plan_for_group as plan_for_group
from jax_kvoffload.transfer._canonical import plan_for_padded_page as plan_for_padded_page
from jax_kvoffload.transfer._canonical_global import (
    canonical_group_caches as canonical_group_caches,
)
from jax_kvoffload.transfer._canonical_global import check_global_caches as check_global_caches
from jax_kvoffload.transfer._canonical_pool import CanonicalPoolView as CanonicalPoolView
from jax_kvoffload.transfer._canonical_pool import plans_for_rank as plans_for_rank
from jax_kvoffload.transfer._engine import TransferEngine as TransferEngine
from jax_kvoffload.transfer._errors import TransferError as TransferError
from jax_kvoffload.transfer._errors import TransferStateError as TransferStateError
from jax_kvoffload.transfer._job_types import Direction as Direction
from jax_kvoffload.transfer._job_types import GroupTransfer as GroupTransfer
from jax_kvoffload.transfer._job_types import TransferResult as TransferResult
from jax_kvoffload.transfer._medium import Medium as Medium
from jax_kvoffload.transfer._medium import TransferPath as TransferPath

__all__ = [
    "CanonicalGroupPlan",
    "CanonicalPoolView",
    "Direction",
    "GroupCaches",
    "GroupTransfer",
    "Medium",
    "TransferEngine",
    "TransferError",
    "TransferPath",
    "TransferResult",
    "TransferStateError",
    "bucket_sizes",
    "canonical_block_bytes",
    "canonical_group_caches",
    "check_global_caches",
    "group_layer_pages",
    "layer_view",
    "plan_for_group",
    "plan_for_padded_page",
    "plans_for_rank",
]
