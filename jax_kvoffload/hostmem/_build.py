"""The one place host pools are built: which pool class, over which memory.

Every caller that needs a pool for a config comes here: `assembly.assemble_host_tier`
(`KVOffloader`: `host_pool` "numpy" or "pinned"), vLLM's torch worker (its private
pool), and `JaxOffloadingSpec`'s workers (canonical and replicated pages in a region
every worker maps; with secondary tiers, vLLM's `SharedOffloadRegion` layout that the
scheduler maps too). What differs between them is described by the arguments, never by
a pool class chosen at the call site; how big a pool is (vLLM's sizing rules) stays
with the callers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from jax_kvoffload.config.internals import HOST_POOLS
from jax_kvoffload.errors import KVOffloadTypeError
from jax_kvoffload.hostmem._host_pool import HostChunkPool
from jax_kvoffload.hostmem._pinned_pool import PinnedRowPool
from jax_kvoffload.hostmem._pool_base import HostPool, HostPoolError
from jax_kvoffload.hostmem._row_pool import ChunkRowPool
from jax_kvoffload.hostmem._shared_region import SharedHostRegion

__all__ = ["SharedRows", "build_host_pool"]


@dataclass(frozen=True)
class SharedRows:
    """Pool rows in a `SharedHostRegion` that several processes of one engine map.

    Attributes:
      name: the region's name (the region hashes it with the user id: only this user's
        processes join).
      attachments: the processes that map it (every worker; plus the scheduler when
        its secondary tiers read and fill the rows).
      rank: this process's slot, in `[0, attachments)`.
      row_stride: None: the rows are laid out as a `HostChunkPool`'s (each group's rows
        one after another). Else vLLM's `SharedOffloadRegion`: chunk c is the
        `row_stride` bytes at `c * row_stride`, holding every worker's bytes
        (`ChunkRowPool`).
      area_offset: with `row_stride`, where this process's bytes start in each row.
    """

    name: str
    attachments: int
    rank: int
    row_stride: int | None = None
    area_offset: int = 0

    def region_bytes(
        self, num_chunks: int, bytes_per_block: Mapping[int, int], blocks_per_chunk: int
    ) -> int:
        """Bytes of the region for a pool of this shape."""
        if self.row_stride is None:
            return HostChunkPool.nbytes_for(num_chunks, bytes_per_block, blocks_per_chunk)
        return num_chunks * self.row_stride


def build_host_pool(
    num_chunks: int,
    bytes_per_block: Mapping[int, int],
    blocks_per_chunk: int,
    *,
    kind: str = "numpy",
    shared: SharedRows | None = None,
    accelerator: bool = False,
    buffer: np.ndarray | None = None,
) -> tuple[HostPool, SharedHostRegion | None]:
    """A host pool of `num_chunks` chunks of `blocks_per_chunk` blocks, `bytes_per_block[g]`
    bytes per block of group g, and the region it lives in (None: this process's memory).

    Args:
      kind: "numpy" (`HostChunkPool`: rows allocated once) or "pinned" (`PinnedRowPool`:
        the host arrays of the stores are the rows), or "auto": "pinned" for caches on
        an `accelerator` (its D2H copies land in their rows, loads read them as they
        are: no host copy), else "numpy"; `HostTierConfig.host_pool`.
      shared: the rows live in a `SharedHostRegion` (opened here; close it when the pool
        is no longer used): a `HostChunkPool` over it, or with `shared.row_stride` a
        `ChunkRowPool`. Only "numpy" pools can be shared.

      buffer: "numpy" rows over this memory of the caller's (1-D uint8, e.g. vLLM's
        worker's pinned slots) instead of fresh memory; not with `shared`.

    If the pool cannot be built over the region, the region is closed again.
    """
    if not isinstance(kind, str):
        raise KVOffloadTypeError(
            f"kind must be a pool name, one of {HOST_POOLS}, got {type(kind).__name__}"
        )
    if kind not in HOST_POOLS:
        raise HostPoolError(f"kind={kind!r} is not a host pool; use one of {HOST_POOLS}")
    if kind == "auto":
        kind = "pinned" if accelerator and shared is None else "numpy"
    if shared is None:
        if kind == "pinned":
            if buffer is not None:
                raise HostPoolError("kind='pinned' makes its own rows; a buffer needs 'numpy'")
            return PinnedRowPool(num_chunks, bytes_per_block, blocks_per_chunk), None
        return HostChunkPool(num_chunks, bytes_per_block, blocks_per_chunk, buffer=buffer), None
    if buffer is not None:
        raise HostPoolError("buffer and shared both name the rows' memory; pass one")
    if kind != "numpy":
        raise HostPoolError(
            f"kind={kind!r} cannot be shared: its rows are the arrays of this process's "
            "stores; use kind='numpy' for rows in a shared region"
        )
    nbytes = shared.region_bytes(num_chunks, bytes_per_block, blocks_per_chunk)
    region = SharedHostRegion(shared.name, nbytes, shared.attachments, rank=shared.rank)
    try:
        if shared.row_stride is None:
            pool: HostPool = HostChunkPool(
                num_chunks, bytes_per_block, blocks_per_chunk, buffer=region.array
            )
        else:
            pool = ChunkRowPool(
                region.array,
                num_chunks,
                bytes_per_block,
                blocks_per_chunk,
                row_stride=shared.row_stride,
                area_offset=shared.area_offset,
            )
    except BaseException:  # on any exit: the region (memfd, mapping) is closed
        region.close()
        raise
    return pool, region
