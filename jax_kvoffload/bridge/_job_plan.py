"""Splits one vLLM transfer job into per-tensor moves, exactly as vLLM's handler does.

vLLM 0.33.0 `SingleDirectionOffloadingHandler.transfer_async`
(`vllm/v1/kv_offload/cpu/gpu_worker.py`): the device spec lists `group_sizes[g]` blocks
per group and `block_indices[g]`, the request-level index of the group's first block.
The host list is chunk-granular: group g consumes
`cdiv(size + skip, bpc)` chunk ids, `skip = block_index % bpc`, and its blocks land in
chunk slots from `skip` on, so a list may start and end mid-chunk. Groups of size 0
consume nothing, and both lists must be consumed exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["JobSpecError", "TensorMove", "plan_job"]


class JobSpecError(ValueError):
    """A transfer job's specs do not describe a valid move (vLLM asserts instead)."""


@dataclass(frozen=True)
class TensorMove:
    """The blocks of one group moved for one registered tensor."""

    tensor: int
    block_ids: tuple[int, ...]
    chunk_ids: tuple[int, ...]
    first_slot: int


def _int_list(name: str, values: Any) -> list[int]:
    arr = np.asarray(values if values is not None else [], dtype=np.int64).reshape(-1)
    if arr.size and arr.min() < 0:
        raise JobSpecError(f"{name} must be >= 0, got {arr.tolist()[:8]}")
    return arr.tolist()


def plan_job(
    device_block_ids: Any,
    group_sizes: Sequence[int] | None,
    block_indices: Sequence[int] | None,
    host_chunk_ids: Any,
    group_refs: Sequence[Sequence[tuple[int, int]]],
    blocks_per_chunk: int,
) -> tuple[list[TensorMove], int]:
    """Returns the moves of a job and its size in bytes (unpadded pages, as vLLM counts).

    Raises:
      JobSpecError: the group counts, sizes or list lengths do not match.
    """
    blocks = _int_list("device block ids", device_block_ids)
    chunks = _int_list("host chunk ids", host_chunk_ids)
    sizes = _int_list("group_sizes", [len(blocks)] if group_sizes is None else group_sizes)
    starts = _int_list(
        "block_indices", [0] * len(sizes) if block_indices is None else block_indices
    )
    if len(sizes) != len(group_refs) or len(starts) != len(sizes):
        raise JobSpecError(
            f"a job lists {len(sizes)} group sizes and {len(starts)} block indices; the "
            f"worker has {len(group_refs)} groups and needs one of each per group"
        )
    if sum(sizes) != len(blocks):
        raise JobSpecError(
            f"group_sizes sum to {sum(sizes)} but {len(blocks)} block ids were given"
        )
    moves: list[TensorMove] = []
    size_bytes = 0
    bpc = blocks_per_chunk
    b_off = c_off = 0
    for g, (size, start) in enumerate(zip(sizes, starts, strict=True)):
        if size == 0:
            continue
        skip = start % bpc
        count = -(-(size + skip) // bpc)
        if c_off + count > len(chunks):
            raise JobSpecError(
                f"group {g}: {size} blocks from slot {skip} need {count} chunks, but only "
                f"{len(chunks) - c_off} chunk ids are left"
            )
        ids = tuple(blocks[b_off : b_off + size])
        group_chunks = tuple(chunks[c_off : c_off + count])
        b_off += size
        c_off += count
        seen: set[int] = set()
        for tensor, unpadded in group_refs[g]:
            size_bytes += size * unpadded
            if tensor not in seen:  # aliased layers share one tensor: move it once
                seen.add(tensor)
                moves.append(TensorMove(tensor, ids, group_chunks, skip))
    if c_off != len(chunks):
        raise JobSpecError(f"the job lists {len(chunks)} chunk ids but its groups use {c_off}")
    return moves, size_bytes
