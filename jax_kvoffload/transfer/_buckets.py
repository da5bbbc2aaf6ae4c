"""Bucketing of block counts so that only a handful of shapes ever compile.

A request for n blocks is split into pieces whose sizes are powers of two no larger than
`max_bucket` (n = 13 -> 8 + 4 + 1). Every piece reuses one of log2(max_bucket) + 1
compiled shapes, and no piece is padded: scatters stay free of duplicate ids and no
bytes are moved twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from jax_kvoffload.hostmem.internals import check_index
from jax_kvoffload.transfer._errors import TransferError

T = TypeVar("T")

_MAX_BUCKET = 2**30


def bucket_sizes(n: int, max_bucket: int) -> list[int]:
    """Sizes, largest first, that sum to `n`; each a power of two <= `max_bucket`."""
    n, max_bucket = check_index("n", n), check_index("max_bucket", max_bucket)
    if n < 0:
        raise TransferError(f"n must be >= 0, got {n}")
    if max_bucket > _MAX_BUCKET:  # a block count per kernel call: int32 in XLA's indexing
        raise TransferError(
            f"max_bucket={max_bucket} is past {_MAX_BUCKET} blocks per kernel call; use 256"
        )
    if max_bucket < 1 or max_bucket & (max_bucket - 1):
        fix = 1 << max(max_bucket, 1).bit_length() - 1
        raise TransferError(f"max_bucket must be a power of two >= 1, got {max_bucket}; use {fix}")
    sizes = [max_bucket] * (n // max_bucket)
    rest = n % max_bucket
    bit = max_bucket
    while rest:
        bit >>= 1
        if rest & bit:
            sizes.append(bit)
            rest -= bit
    return sizes


def split(items: Sequence[T], max_bucket: int) -> list[Sequence[T]]:
    """`items` cut into consecutive pieces of `bucket_sizes(len(items), max_bucket)`."""
    out: list[Sequence[T]] = []
    start = 0
    for size in bucket_sizes(len(items), max_bucket):
        out.append(items[start : start + size])
        start += size
    return out


def store_pieces(
    total: int, bucket: int, first_slot: int = 0, per_chunk: int | None = None
) -> list[tuple[int, int]]:
    """(start, blocks) of each kernel call of a store of `total` blocks.

    Power-of-two buckets; with `per_chunk` (the blocks per chunk of a pool that adopts
    its rows) one piece per whole chunk instead, so that a row never keeps a larger
    staging array alive than itself (pieces of partial chunks, and chunks larger than
    `bucket`, are bucketed)."""
    if per_chunk is None:
        out, start = [], 0
        for n in bucket_sizes(total, bucket):
            out.append((start, n))
            start += n
        return out
    out, start = [], 0
    while start < total:
        n = min(total - start, per_chunk - (first_slot + start) % per_chunk)
        for size in [n] if n == per_chunk and n <= bucket else bucket_sizes(n, bucket):
            out.append((start, size))
            start += size
    return out
