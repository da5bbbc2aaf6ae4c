"""Checks on the arguments of `TransferEngine` calls: transfers and job ids.

They run before anything is queued, so a refused call leaves no job behind.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from jax_kvoffload.errors import KVOffloadTypeError
from jax_kvoffload.hostmem import HostPool
from jax_kvoffload.hostmem.internals import check_index, check_indices
from jax_kvoffload.transfer._caches import GroupCaches
from jax_kvoffload.transfer._errors import TransferError, TransferStateError
from jax_kvoffload.transfer._job_types import GroupTransfer


@dataclass(frozen=True)
class CheckedTransfer:
    """A `GroupTransfer` whose ids passed `check_transfer`."""

    group: int
    block_ids: np.ndarray  # int64
    chunk_ids: list[int]
    first_slot: int


def check_transfer(
    i: int, t: object, caches: Mapping[int, GroupCaches], pool: HostPool, unique: bool
) -> CheckedTransfer:
    """`transfers[i]` checked against the caches and the pool (ids in range, ints only;
    a load's block ids unique)."""
    if not isinstance(t, GroupTransfer):
        raise KVOffloadTypeError(f"transfers[{i}] must be a GroupTransfer, got {t!r}")
    group = check_index(f"transfers[{i}].group", t.group)
    if group not in caches:
        raise TransferError(f"unknown group {group}; groups are {sorted(caches)}")
    gc = caches[group]
    ids = check_indices(f"transfers[{i}].block_ids", t.block_ids)
    chunk_ids = check_indices(f"transfers[{i}].chunk_ids", t.chunk_ids)
    first = check_index(f"transfers[{i}].first_slot", t.first_slot)
    bpc = pool.blocks_per_chunk
    slots = first + len(ids)
    if first < 0 or (first >= bpc and len(ids)):
        raise TransferError(f"first_slot={first} must be in [0, {bpc})")
    if len(chunk_ids) * bpc < slots:
        raise TransferError(
            f"group {group}: {len(ids)} blocks from slot {first} need "
            f"{-(-slots // bpc)} chunks, got {len(chunk_ids)}"
        )
    chunks = chunk_ids.tolist()
    if chunks and (min(chunks) < 0 or max(chunks) >= pool.num_chunks):
        bad = [c for c in chunks if not 0 <= c < pool.num_chunks]
        raise TransferError(f"chunk ids {bad[:8]} are outside [0, {pool.num_chunks})")
    # As Python lists: numpy's reductions and np.unique cost ~0.3 ms after an idle pause
    # on the CI VM, a tenth of a small load (a list pass is a few microseconds per id).
    nb = gc.num_blocks
    blocks = ids.tolist()
    if blocks and (min(blocks) < 0 or max(blocks) >= nb):
        bad = [b for b in blocks if not 0 <= b < nb]
        raise TransferError(f"group {group}: block ids must be in [0, {nb}), got {bad[:8]}")
    if unique and len(set(blocks)) != len(blocks):
        raise TransferError(f"group {group}: a load's block ids must be unique")
    if any(a.is_deleted() for a in gc.arrays):
        raise TransferStateError(
            f"group {group}: the cache arrays were deleted (donated elsewhere, or lost "
            "with a failed scatter); hand live arrays over with set_arrays"
        )
    return CheckedTransfer(group, ids, chunks, first)


def check_job_ids(job_ids: object, known: Callable[[int], bool]) -> list[int]:
    """`job_ids` as a list after checking that each is known and listed once."""
    if isinstance(job_ids, (str, bytes)) or not isinstance(job_ids, Iterable):
        raise KVOffloadTypeError(
            f"job_ids must be an iterable of ints, got {type(job_ids).__name__}"
        )
    ids = [check_index("job id", j) for j in job_ids]
    dup = sorted(i for i, n in Counter(ids).items() if n > 1)
    unknown = [i for i in ids if not known(i)]
    if dup or unknown:
        what = "unknown or were already collected" if unknown else "listed twice"
        raise TransferError(
            f"job ids {unknown or dup} are {what}; nothing was collected: pass each job "
            "in flight once"
        )
    return ids


def check_pool(pool: object) -> None:
    if not isinstance(pool, HostPool):
        raise KVOffloadTypeError(
            f"pool must be a HostPool (HostChunkPool, PinnedRowPool, CanonicalPoolView, "
            f"...), got {type(pool).__name__}"
        )
