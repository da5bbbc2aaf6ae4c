"""Splits one vLLM transfer job into per-tensor moves, exactly as vLLM's handler does.

vLLM 0.33.0 `SingleDirectionOffloadingHandler.transfer_async`
(`vllm/v1/kv_offload/cpu/gpu_worker.py`): the device spec lists `group_sizes[g]` blocks
per group and `block_indices[g]`, the request-level index of the group's first block.
The host list is chunk-granular: group g consumes
`cdiv(size + skip, bpc)` chunk ids, `skip = block_index % bpc`, and its blocks land in
chunk slots from `skip` on, so a list may start and end mid-chunk. Groups of size 0
consume nothing, and both lists must be consumed exactly.

Per block and ref, vLLM copies the ref's *unpadded* `page_size_bytes` from the start of
the block's row (`_fill_direct_ops`), and counts them in `transfer_size` once per ref.
Refs of one group on the same tensor (aliased layers) copy the same leading bytes, so
the bytes moved per block are the widest of them; the size still counts every ref.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from jax_kvoffload.errors import KVOffloadTypeError, KVOffloadValueError

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

__all__ = ["JobSpecError", "JobSpecTypeError", "TensorMove", "int_ids", "plan_job"]


class JobSpecError(KVOffloadValueError):
    """A transfer job's specs do not describe a valid move (vLLM asserts instead)."""


class JobSpecTypeError(KVOffloadTypeError):
    """A transfer job's ids are not integers (e.g. floats, which would be truncated)."""


@dataclass(frozen=True)
class TensorMove:
    """The blocks of one group moved for one registered tensor.

    `width` is the bytes moved per block (the widest unpadded page of the group's refs
    on the tensor, from the start of the block's row); `refs` is how many of the group's
    refs point at the tensor (vLLM counts each in `transfer_size`)."""

    tensor: int
    block_ids: tuple[int, ...]
    chunk_ids: tuple[int, ...]
    first_slot: int
    width: int = 0
    refs: int = 1


def int_ids(name: str, values: ArrayLike | None) -> list[int]:
    """`values` (a sequence or array of integers) as a list of Python ints, all >= 0.

    Raises:
      JobSpecTypeError: a value is not an integer (floats, bools and strings are refused:
        `np.asarray(..., dtype=np.int64)` would truncate 2.7 to 2 and move another block).
      JobSpecError: a value is negative.
    """
    if values is None:
        return []
    if isinstance(values, (str, bytes)) or np.ndim(values) != 1:
        raise JobSpecTypeError(
            f"{name} must be a flat sequence of integers, got {type(values).__name__} "
            f"{values!r:.80}"
        )
    arr = np.asarray(values)
    if arr.size == 0:
        return []
    if arr.dtype.kind in "iu":
        out = arr.tolist()
    elif arr.dtype.kind == "O" and not any(isinstance(v, bool) for v in arr.tolist()):
        try:
            out = [operator.index(v) for v in arr.tolist()]
        except TypeError:
            out = None
    else:
        out = None
    if out is None:
        sample = arr.tolist()[:8]
        raise JobSpecTypeError(
            f"{name} must be integers, got {arr.dtype} values {sample}; pass whole numbers "
            "(a float id would be truncated and move another block)"
        )
    if min(out) < 0:
        raise JobSpecError(f"{name} must be >= 0, got {out[:8]}")
    return out


def plan_job(
    device_block_ids: ArrayLike,
    group_sizes: Sequence[int] | None,
    block_indices: Sequence[int] | None,
    host_chunk_ids: ArrayLike,
    group_refs: Sequence[Sequence[tuple[int, int]]],
    blocks_per_chunk: int,
) -> tuple[list[TensorMove], int]:
    """Returns the moves of a job and its size in bytes (unpadded pages, as vLLM counts).

    `group_refs[g]` lists the `(tensor_idx, unpadded_page_bytes)` of group g's refs.

    Raises:
      JobSpecTypeError: an id, size or index is not an integer.
      JobSpecError: the group counts, sizes or list lengths do not match.
    """
    blocks = int_ids("device block ids", device_block_ids)
    chunks = int_ids("host chunk ids", host_chunk_ids)
    sizes = int_ids("group_sizes", [len(blocks)] if group_sizes is None else group_sizes)
    starts = int_ids("block_indices", [0] * len(sizes) if block_indices is None else block_indices)
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
        widths: dict[int, int] = {}
        counts: dict[int, int] = {}
        for tensor, unpadded in group_refs[g]:
            size_bytes += size * unpadded
            widths[tensor] = max(widths.get(tensor, 0), unpadded)
            counts[tensor] = counts.get(tensor, 0) + 1
        for tensor, width in widths.items():  # aliased refs: one move per tensor
            if width:
                moves.append(TensorMove(tensor, ids, group_chunks, skip, width, counts[tensor]))
    if c_off != len(chunks):
        raise JobSpecError(f"the job lists {len(chunks)} chunk ids but its groups use {c_off}")
    return moves, size_bytes
