"""Worker side: move KV blocks between device caches and pre-allocated host memory.

`TransferEngine` runs the gather/scatter kernels of `pallas_kernels` and `jax.device_put`
asynchronously over a `HostChunkPool`. See docs/architecture.md.
"""

from jax_kvoffload.transfer._buckets import bucket_sizes as bucket_sizes
from jax_kvoffload.transfer._engine import GroupCaches as GroupCaches
from jax_kvoffload.transfer._engine import TransferEngine as TransferEngine
from jax_kvoffload.transfer._host_pool import HostChunkPool as HostChunkPool
from jax_kvoffload.transfer._host_pool import HostPoolError as HostPoolError
from jax_kvoffload.transfer._jobs import Direction as Direction
from jax_kvoffload.transfer._jobs import GroupTransfer as GroupTransfer
from jax_kvoffload.transfer._jobs import TransferError as TransferError
from jax_kvoffload.transfer._jobs import TransferResult as TransferResult

__all__ = [
    "Direction",
    "GroupCaches",
    "GroupTransfer",
    "HostChunkPool",
    "HostPoolError",
    "TransferEngine",
    "TransferError",
    "TransferResult",
    "bucket_sizes",
]
