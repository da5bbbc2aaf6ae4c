"""Canonical page mappings: the byte runs between a worker's page and the canonical page.

The canonical page of a layer is the full offloaded block without parallelism: all KV
heads and all `block_size * dcp * pcp` tokens, in the worker's own page encoding (packed
K|V or split K/V halves, NHD or HND order). This module derives, for one layer at one
rank, which bytes of the worker's page land where in the canonical page (vLLM 0.33.0,
`vllm/distributed/kv_transfer/kv_connector/v1/offloading/canonical_mapping.py`). It is
pure Python: the physical page is described by a `KVTensorView` (logical shape, strides,
element size) instead of a torch tensor, so JAX, numpy and torch caches are certified the
same way.

A refusal is a reason string (`layer_mapping_or_reason`) or None (`layer_mapping`, vLLM's
signature); nothing here guesses: an unrecognised layout is refused, never approximated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jax_kvoffload.config._errors import ConfigFieldError
from jax_kvoffload.config._specs import AttentionSpec


@dataclass(frozen=True)
class CopyRun:
    """Fragment i covers `[local_offset + i*local_stride, +fragment_size)` of the worker's
    page and `[canonical_offset + i*canonical_stride, +fragment_size)` of the canonical
    page (bytes)."""

    local_offset: int
    canonical_offset: int
    fragment_size: int
    num_fragments: int
    local_stride: int
    canonical_stride: int

    def fragments(self) -> list[tuple[int, int, int]]:
        """The expanded `(local, canonical, size)` triples."""
        return [
            (
                self.local_offset + i * self.local_stride,
                self.canonical_offset + i * self.canonical_stride,
                self.fragment_size,
            )
            for i in range(self.num_fragments)
        ]


@dataclass(frozen=True)
class CanonicalPageMapping:
    """Where one rank's page of one layer lives in the layer's canonical page.

    Attributes:
      canonical_page_size_bytes: bytes of the canonical page (every rank agrees).
      local_page_size_bytes: bytes of this rank's (unpadded) page.
      runs: the byte runs; together they cover the local page exactly once.
      num_writers: how many ranks hold identical bytes for each canonical byte.
      writer_index: this rank's turn among them; it writes block `b` iff `is_writer(b)`.
      parallelism_agnostic: the canonical page does not depend on the topology (no CP).
    """

    canonical_page_size_bytes: int
    local_page_size_bytes: int
    runs: tuple[CopyRun, ...]
    num_writers: int = 1
    writer_index: int = 0
    parallelism_agnostic: bool = True

    def is_writer(self, block_id: int) -> bool:
        """Ranks holding identical bytes take turns per canonical block."""
        return block_id % self.num_writers == self.writer_index

    def fragments(self) -> list[tuple[int, int, int]]:
        return [f for run in self.runs for f in run.fragments()]


@dataclass(frozen=True)
class RankContext:
    """Sharding parameters of one worker rank within the TP x PCP offload group."""

    tp_size: int
    dcp_size: int
    pcp_size: int
    interleave: int
    total_kv_heads: int
    rank: int

    @property
    def cp_size(self) -> int:
        return self.dcp_size * self.pcp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def total_cp_rank(self) -> int:
        pcp_rank = self.rank // self.tp_size
        return pcp_rank * self.dcp_size + self.tp_rank % self.dcp_size

    def canonical_token(self, local_index: int) -> int:
        """Canonical position of this rank's local token `local_index` (CP interleaving)."""
        chunk, pos = divmod(local_index, self.interleave)
        return (chunk * self.cp_size + self.total_cp_rank) * self.interleave + pos


@dataclass(frozen=True)
class KVTensorView:
    """A layer's physical KV cache as a strided view, like a torch tensor's metadata.

    `shape` is the logical shape and `strides` its strides in elements; `itemsize` is the
    element size in bytes. Certified forms (per page; the block stride is never read):
    packed K|V `(num_blocks, heads, block_size, 2*head_size)` and split K/V halves
    `(num_blocks, 2, block_size, heads, head_size)`, each with NHD or HND strides.
    """

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int

    @classmethod
    def packed(
        cls,
        num_blocks: int,
        heads: int,
        block_size: int,
        head_size: int,
        itemsize: int,
        order: str = "nhd",
    ) -> KVTensorView:
        """K and V adjacent per (token, head): page `[bs, heads, 2hs]` (NHD) or
        `[heads, bs, 2hs]` (HND)."""
        e = 2 * head_size
        page = heads * block_size * e
        if order == "nhd":
            strides = (page, e, heads * e, 1)
        elif order == "hnd":
            strides = (page, block_size * e, e, 1)
        else:
            raise ConfigFieldError("order", f"got {order!r}; use 'nhd' or 'hnd'")
        return cls((num_blocks, heads, block_size, e), strides, itemsize)

    @classmethod
    def split(
        cls,
        num_blocks: int,
        heads: int,
        block_size: int,
        head_size: int,
        itemsize: int,
        order: str = "nhd",
    ) -> KVTensorView:
        """K half then V half: each half `[bs, heads, hs]` (NHD) or `[heads, bs, hs]` (HND)."""
        half = block_size * heads * head_size
        if order == "nhd":
            strides = (2 * half, half, heads * head_size, head_size, 1)
        elif order == "hnd":
            strides = (2 * half, half, head_size, block_size * head_size, 1)
        else:
            raise ConfigFieldError("order", f"got {order!r}; use 'nhd' or 'hnd'")
        return cls((num_blocks, 2, block_size, heads, head_size), strides, itemsize)


@dataclass(frozen=True)
class ByteRegion:
    """A region of the page that repeats once per local token."""

    local_offset: int
    canonical_offset: int
    bytes_per_token: int
    canonical_token_stride: int


def coalesce_runs(runs: Sequence[CopyRun]) -> tuple[CopyRun, ...]:
    """Merges contiguous fragments within and across runs (vLLM's `_coalesce_runs`): a single-rank
    mapping becomes one whole-page run."""
    out: list[CopyRun] = []
    for run in runs:
        if (
            run.num_fragments > 1
            and run.local_stride == run.fragment_size
            and run.canonical_stride == run.fragment_size
        ):
            size = run.fragment_size * run.num_fragments
            run = CopyRun(run.local_offset, run.canonical_offset, size, 1, size, size)
        prev = out[-1] if out else None
        if (
            prev is not None
            and prev.num_fragments == 1
            and run.num_fragments == 1
            and prev.local_offset + prev.fragment_size == run.local_offset
            and prev.canonical_offset + prev.fragment_size == run.canonical_offset
        ):
            size = prev.fragment_size + run.fragment_size
            out[-1] = CopyRun(prev.local_offset, prev.canonical_offset, size, 1, size, size)
        else:
            out.append(run)
    return tuple(out)


def interleave_tokens(
    regions: Sequence[ByteRegion], num_tokens: int, ctx: RankContext
) -> tuple[CopyRun, ...]:
    """Places each region's `num_tokens` rows at their canonical token positions: one run
    per region without CP, one run per chunk of `interleave` tokens with CP."""
    runs: list[CopyRun] = []
    for r in regions:
        if ctx.cp_size == 1:
            runs.append(
                CopyRun(
                    r.local_offset,
                    r.canonical_offset,
                    r.bytes_per_token,
                    num_tokens,
                    r.bytes_per_token,
                    r.canonical_token_stride,
                )
            )
            continue
        for start in range(0, num_tokens, ctx.interleave):
            runs.append(
                CopyRun(
                    r.local_offset + start * r.bytes_per_token,
                    r.canonical_offset + ctx.canonical_token(start) * r.canonical_token_stride,
                    r.bytes_per_token,
                    ctx.interleave,
                    r.bytes_per_token,
                    r.canonical_token_stride,
                )
            )
    return coalesce_runs(runs)


def _packed_regions(
    view: KVTensorView, spec: AttentionSpec, shard: int, shards: int, cp: int
) -> list[ByteRegion] | str:
    bs, heads, elem = spec.block_size, spec.num_kv_heads, view.itemsize
    e = 2 * spec.head_size
    if heads * bs * e * elem != spec.real_page_size_bytes:
        return "packed K|V bytes do not match the spec's page (head_size_v != head_size?)"
    _, head_stride, token_stride, inner = view.strides
    if inner != 1:
        return "the innermost stride is not 1"
    head_bytes = e * elem
    row = heads * head_bytes
    if head_stride == e and token_stride == heads * e:  # NHD
        return [ByteRegion(0, shard * row, row, shards * row)]
    if head_stride == bs * e and token_stride == e:  # HND
        span = bs * cp
        return [
            ByteRegion(
                h * bs * head_bytes, (shard * heads + h) * span * head_bytes, head_bytes, head_bytes
            )
            for h in range(heads)
        ]
    return "packed K|V strides are neither NHD nor HND"


def _split_regions(
    view: KVTensorView, spec: AttentionSpec, shard: int, shards: int, cp: int
) -> list[ByteRegion] | str:
    bs, heads, hs, elem = spec.block_size, spec.num_kv_heads, spec.head_size, view.itemsize
    if 2 * bs * heads * hs * elem != spec.real_page_size_bytes:
        return "split K/V bytes do not match the spec's page (head_size_v != head_size?)"
    _, half_stride, token_stride, head_stride, inner = view.strides
    if inner != 1 or half_stride != bs * heads * hs:
        return "the innermost stride is not 1 or K and V are not contiguous page halves"
    head_bytes = hs * elem
    row = heads * head_bytes
    span = bs * cp
    if token_stride == heads * hs and head_stride == hs:  # NHD
        return [
            ByteRegion(half * bs * row, half * span * shards * row + shard * row, row, shards * row)
            for half in range(2)
        ]
    if head_stride == bs * hs and token_stride == hs:  # HND
        total = shards * heads
        return [
            ByteRegion(
                half * bs * row + h * bs * head_bytes,
                (half * total + shard * heads + h) * span * head_bytes,
                head_bytes,
                head_bytes,
            )
            for half in range(2)
            for h in range(heads)
        ]
    return "split K/V strides are neither NHD nor HND"


def _byte_regions(
    view: KVTensorView, spec: AttentionSpec, num_blocks: int, shard: int, shards: int, cp: int
) -> list[ByteRegion] | str:
    bs, heads, hs = spec.block_size, spec.num_kv_heads, spec.head_size
    if view.shape == (num_blocks, heads, bs, 2 * hs) and len(view.strides) == 4:
        return _packed_regions(view, spec, shard, shards, cp)
    if view.shape == (num_blocks, 2, bs, heads, hs) and len(view.strides) == 5:
        return _split_regions(view, spec, shard, shards, cp)
    return (
        f"physical shape {view.shape} is neither packed K|V {(num_blocks, heads, bs, 2 * hs)} "
        f"nor split K/V {(num_blocks, 2, bs, heads, hs)}"
    )
