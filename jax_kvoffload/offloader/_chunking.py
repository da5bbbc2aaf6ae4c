"""A `KVOffloader` call's blocks as chunks: the chunk keys of the caller's block hashes,
the block rows of each chunk, and the store transfer of the chunks the host takes.

A chunk's key is its last block's hash: that hash covers the whole prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_kvoffload.offloader._checks import OffloaderError, check_block_ids, check_hashes
from jax_kvoffload.store import OffloadKey, PrepareStoreOutput
from jax_kvoffload.transfer import GroupTransfer

__all__ = ["chunk_hashes", "chunks", "store_transfer"]


def chunk_hashes(block_hashes: Sequence[bytes], blocks_per_chunk: int) -> list[bytes]:
    """The key hash of each whole chunk of `block_hashes` (a partial tail has none)."""
    n = len(block_hashes) // blocks_per_chunk
    return [bytes(block_hashes[(c + 1) * blocks_per_chunk - 1]) for c in range(n)]


def chunks(
    block_hashes: object,
    block_ids: object,
    blocks_per_chunk: int,
    num_blocks: int,
    group: int,
    unique: bool = False,
) -> tuple[list[bytes], list[list[int]]]:
    """The caller's hashes and block ids, checked, as (chunk key hashes, each chunk's
    block ids); `unique`: a load's ids may not repeat."""
    hashes_in = check_hashes(block_hashes)
    ids = check_block_ids(block_ids, len(hashes_in), num_blocks, group)
    hashes = chunk_hashes(hashes_in, blocks_per_chunk)
    whole = ids[: len(hashes) * blocks_per_chunk]
    if unique and np.unique(whole).size != whole.size:
        raise OffloaderError(f"group {group}: a load's block ids must be unique")
    return hashes, whole.reshape(len(hashes), blocks_per_chunk).tolist()


def store_transfer(
    group: int, keys: list[OffloadKey], ids: list[list[int]], out: PrepareStoreOutput
) -> GroupTransfer:
    """The store of the chunks `prepare_store` gave rows (`out`): their blocks, by the
    first position of each key among the caller's."""
    position: dict[OffloadKey, int] = {}
    for i, k in enumerate(keys):
        position.setdefault(k, i)
    blocks = tuple(b for key in out.keys_to_store for b in ids[position[key]])
    return GroupTransfer(group, blocks, tuple(out.chunk_ids))
