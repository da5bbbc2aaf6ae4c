"""A rank's view of a shared canonical host pool, usable wherever a `HostChunkPool` is.

The shared `HostChunkPool` holds canonical block rows (`canonical_block_bytes` per block
per group); every rank of the TP x PCP group writes its own bytes into the same rows and
reads its page back from them. `CanonicalPoolView` presents the rank's local block width
to a `TransferEngine` (which is unchanged: its store worker calls `write_blocks` after the
device-to-host copy, its load worker `read_blocks` before the host-to-device copy), and
relays every call through the group's `CanonicalGroupPlan`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from jax_kvoffload.config import CanonicalRegistration
from jax_kvoffload.hostmem import HostChunkPool, HostPool, HostPoolError
from jax_kvoffload.transfer._canonical import (
    CanonicalGroupPlan,
    group_layer_pages,
    plan_for_group,
)
from jax_kvoffload.transfer._engine import GroupCaches
from jax_kvoffload.transfer._errors import TransferError

logger = logging.getLogger(__name__)


class CanonicalPoolView(HostPool):
    """This rank's window on a canonical `HostChunkPool` (a `HostPool`).

    Threading: as `HostChunkPool`; ranks write disjoint bytes of a row (tiling is verified
    at registration), so several ranks may store into the same chunk concurrently. Whole
    rows (`chunk_row`, for secondary tiers) are the shared pool's canonical rows: every
    rank's bytes, portable across topologies.

    Args:
      pool: the shared pool (a `HostChunkPool`, or a `ChunkRowPool` over vLLM's shared
        rows, which secondary tiers read); `pool.bytes_per_block[g]` is the canonical
        block width.
      plans: group id -> this rank's `CanonicalGroupPlan`.
    """

    def __init__(self, pool: HostPool, plans: Mapping[int, CanonicalGroupPlan]) -> None:
        for g, plan in plans.items():
            if pool.bytes_per_block.get(g) != plan.canonical_block_bytes:
                raise TransferError(
                    f"group {g}: the shared pool holds {pool.bytes_per_block.get(g)} bytes "
                    f"per block but canonical rows are {plan.canonical_block_bytes}; size "
                    "the pool with canonical_block_bytes"
                )
        self.pool = pool
        self.plans = dict(plans)
        self.num_chunks = pool.num_chunks
        self.blocks_per_chunk = pool.blocks_per_chunk
        self.bytes_per_block = {g: p.local_block_bytes for g, p in self.plans.items()}
        self.bytes_written = 0  # canonical bytes this rank stored (writer rotation applied)
        self.host_copies = pool.host_copies  # the relayout copies with the CPU: counted

    @property
    def nbytes(self) -> int:
        return self.pool.nbytes

    def chunk_row(self, group: int, chunk: int) -> np.ndarray:
        return self.pool.chunk_row(group, chunk)

    def chunk_row_for_write(self, group: int, chunk: int) -> np.ndarray:
        return self.pool.chunk_row_for_write(group, chunk)

    def row_bytes(self, group: int) -> int:
        return self.pool.row_bytes(group)

    def _plan(self, group: int) -> CanonicalGroupPlan:
        try:
            return self.plans[group]
        except KeyError:
            raise HostPoolError(
                f"group {group} has no canonical plan; groups are {sorted(self.plans)}"
            ) from None

    def store_bytes(self, group: int, chunk_ids: list[int], first: int, n_blocks: int) -> int:
        """Bytes this rank writes when storing `n_blocks` blocks there (its runs of the
        blocks it is a writer for): what vLLM reports as a canonical store's size."""
        return self._plan(group).store_bytes(self.pool.slots(chunk_ids, first, n_blocks))

    def write_blocks(self, group: int, chunk_ids: list[int], first: int, data: np.ndarray) -> None:
        """Stores this rank's bytes of `data` (`[n, local_block_bytes]` uint8)."""
        plan = self._plan(group)
        slots = self.pool.slots(chunk_ids, first, data.shape[0])
        if isinstance(self.pool, HostChunkPool):
            written = plan.store(self.pool.flat(group), slots, data)
        else:
            written = 0
            for rows, k, at, pages in self._by_chunk(group, slots):
                written += plan.store(rows, k, data[at : at + k.size], page_ids=pages)
        self.bytes_written += written
        self.host_copies.add(written, store=True)

    def read_blocks(
        self, group: int, chunk_ids: list[int], first: int, n_blocks: int, out: np.ndarray
    ) -> np.ndarray:
        """Reads this rank's pages of `n_blocks` canonical blocks into `out`."""
        plan = self._plan(group)
        slots = self.pool.slots(chunk_ids, first, n_blocks)
        if isinstance(self.pool, HostChunkPool):
            out = plan.load(self.pool.flat(group), slots, out)
        else:
            for rows, k, at, _ in self._by_chunk(group, slots):
                plan.load(rows, k, out[at : at + k.size])
        self.host_copies.add(out.nbytes, store=False)
        return out

    def _by_chunk(
        self, group: int, slots: np.ndarray
    ) -> Iterator[tuple[np.ndarray, np.ndarray, int, np.ndarray]]:
        """Per run of slots in one chunk: the chunk's `[blocks_per_chunk, width]` rows,
        the slots' places in them, where the run starts, and its canonical page ids.

        For pools whose chunks are not one array of block rows (`ChunkRowPool`: vLLM's
        shared rows, where each chunk's row holds every group's pages, so a group's
        blocks are contiguous within a chunk only)."""
        bpc = self.blocks_per_chunk
        chunks = slots // bpc
        cuts = np.flatnonzero(np.diff(chunks)) + 1
        for at, run in zip([0, *cuts.tolist()], np.split(slots, cuts), strict=True):
            rows = self.pool.chunk_row_for_write(group, int(run[0]) // bpc).reshape(bpc, -1)
            yield rows, run % bpc, at, run


def plans_for_rank(
    registration: CanonicalRegistration,
    group_layers: Mapping[int, Sequence[str]],
    caches: Mapping[int, GroupCaches],
    rank: int | None = None,
) -> dict[int, CanonicalGroupPlan]:
    """Each group's plan for `rank` (default: the registered rank).

    `group_layers[g]` names the group's layers in the order of `caches[g].arrays` (for
    SEPARATE K and V arrays, one name per pair)."""
    rank = registration.rank if rank is None else rank
    plans = {}
    for g, names in group_layers.items():
        gc = caches[g]
        shapes = [tuple(a.shape) for a in gc.arrays]
        pages = group_layer_pages(gc.layout, shapes, gc.arrays[0].dtype.itemsize)
        missing = [n for n in names if n not in registration.layers]
        if missing:
            raise TransferError(f"group {g}: layers {missing} have no canonical mapping")
        mappings = [registration.layers[n].mappings[rank] for n in names]
        plans[g] = plan_for_group(mappings, pages)
        logger.debug(
            "group %d rank %d: canonical plan, %d strided copies, identity %s",
            g,
            rank,
            len(plans[g].copies),
            plans[g].identity,
        )
    return plans
