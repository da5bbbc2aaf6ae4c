"""Host memory: where offloaded chunks live on the host, and how processes share it.

`HostPool` is the contract every pool keeps (who writes a row, on which thread, what a
caller may keep); `HostChunkPool` (numpy rows allocated once), `PinnedRowPool` (the host
arrays `device_put` returned are the rows) and `ChunkRowPool` (vLLM's shared offload
region layout) implement it. `SharedHostRegion` is one memory for the worker processes
of an engine (a memfd, private to the user; docs/security.md). `build_host_pool` is the
one place a pool is built for a config.

Sits below `transfer` (which moves bytes between device caches and these rows) and
imports only `config` and `errors`: no JAX. See docs/architecture.md.
"""

from jax_kvoffload.hostmem._build import SharedRows as SharedRows
from jax_kvoffload.hostmem._build import build_host_pool as build_host_pool
from jax_kvoffload.hostmem._copy_count import HostCopies as HostCopies
from jax_kvoffload.hostmem._host_pool import HostChunkPool as HostChunkPool
from jax_kvoffload.hostmem._pinned_pool import PinnedRowPool as PinnedRowPool
from jax_kvoffload.hostmem._pool_base import HostPool as HostPool
from jax_kvoffload.hostmem._pool_base import HostPoolError as HostPoolError
from jax_kvoffload.hostmem._row_pool import ChunkRowPool as ChunkRowPool
from jax_kvoffload.hostmem._shared_region import SharedHostRegion as SharedHostRegion
from jax_kvoffload.hostmem._shm_errors import ForeignPeerError as ForeignPeerError
from jax_kvoffload.hostmem._shm_errors import (
    SharedRegionArgumentError as SharedRegionArgumentError,
)
from jax_kvoffload.hostmem._shm_errors import SharedRegionError as SharedRegionError
from jax_kvoffload.hostmem._shm_errors import SharedRegionTimeoutError as SharedRegionTimeoutError

__all__ = [
    "ChunkRowPool",
    "ForeignPeerError",
    "HostChunkPool",
    "HostCopies",
    "HostPool",
    "HostPoolError",
    "PinnedRowPool",
    "SharedHostRegion",
    "SharedRegionArgumentError",
    "SharedRegionError",
    "SharedRegionTimeoutError",
    "SharedRows",
    "build_host_pool",
]
