"""Canonical relayout of one group's block rows: precomputed byte-unit index arrays.

A rank's staging row for one block is its layers' pages back to back (the gather kernel's
output; `GroupCaches` order). The canonical block row is the layers' canonical pages back
to back, in the same layer order. `CanonicalGroupPlan` turns a rank's per-layer
`CanonicalPageMapping`s into index arrays over "units" (the largest byte size dividing
every fragment, offset and page), so a store is one numpy put and a load one take per
batch of blocks, whatever the number of fragments. Writer rotation (spec 4.9): a rank
stores a layer's bytes of canonical block `b` only when `mapping.is_writer(b)`; loads read
every block.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

import pallas_kernels as pk
from jax_kvoffload.config import CanonicalPageMapping, KVTensorView
from jax_kvoffload.transfer._jobs import TransferError


def layer_view(layout: pk.KVLayout, shape: tuple[int, ...], dtype: np.dtype) -> KVTensorView:
    """The certification view of one layer of a `pallas_kernels` cache array.

    NHD/HND without stacking are packed K|V pages (`head_dim` = 2 * head_size); stacked
    (FIRST, SECOND) or separate K and V arrays are split K/V halves; MLA and RAW pages are
    returned as a plain 2-D view (MLA certification ignores it; RAW is refused)."""
    itemsize = np.dtype(dtype).itemsize
    page = layout.page_shape(tuple(shape))
    nb = layout.num_blocks(tuple(shape))
    fmt, stack = layout.page_format, layout.kv_stacking
    if fmt not in (pk.PageFormat.NHD, pk.PageFormat.HND):
        return KVTensorView((nb, math.prod(page)), (math.prod(page), 1), itemsize)
    a, b, e = page[-3:]  # SEPARATE: one half per array; FIRST/SECOND: (2, a, b, e)
    nhd = fmt is pk.PageFormat.NHD
    heads, bs = (b, a) if nhd else (a, b)
    if stack is pk.KVStacking.NONE:  # logical (nb, heads, bs, e), e = K|V packed
        strides = (heads * bs * e, e, heads * e, 1) if nhd else (heads * bs * e, bs * e, e, 1)
        return KVTensorView((nb, heads, bs, e), strides, itemsize)
    return KVTensorView.split(nb, heads, bs, e, itemsize, "nhd" if nhd else "hnd")


def _unit(values: Sequence[int]) -> int:
    g = 0
    for v in values:
        g = math.gcd(g, v)
    return max(g, 1)


@dataclass(frozen=True)
class _WriterClass:
    num_writers: int
    writer_index: int
    local: np.ndarray  # unit indices in the local row
    canonical: np.ndarray  # matching unit indices in the canonical row


class CanonicalGroupPlan:
    """One rank's relayout of one group: local block rows <-> canonical block rows.

    Args:
      layers: per layer, in staging order, `(mapping, local_offset, canonical_offset)`:
        this rank's mapping and where the layer's page starts in the local staging row
        and in the canonical block row (bytes).
      local_block_bytes, canonical_block_bytes: row widths per block.
    """

    def __init__(
        self,
        layers: Sequence[tuple[CanonicalPageMapping, int, int]],
        local_block_bytes: int,
        canonical_block_bytes: int,
    ) -> None:
        sizes = [local_block_bytes, canonical_block_bytes]
        for m, lo, co in layers:
            sizes += [lo, co, *(x for f in m.fragments() for x in f)]
        self.unit = _unit(sizes)
        self.local_block_bytes = local_block_bytes
        self.canonical_block_bytes = canonical_block_bytes
        u = self.unit
        classes: dict[tuple[int, int], tuple[list[np.ndarray], list[np.ndarray]]] = {}
        full = np.full(local_block_bytes // u, -1, dtype=np.int64)
        for m, lo, co in layers:
            loc, can = classes.setdefault((m.num_writers, m.writer_index), ([], []))
            for lf, cf, n in m.fragments():
                k = np.arange(n // u, dtype=np.int64)
                loc.append((lo + lf) // u + k)
                can.append((co + cf) // u + k)
                full[(lo + lf) // u + k] = (co + cf) // u + k
        if (full < 0).any():
            raise TransferError(
                f"the layer mappings cover {int((full >= 0).sum()) * u} of the "
                f"{local_block_bytes} bytes of a block row; every byte must have a place"
            )
        self._load_index = full
        self._classes = tuple(
            _WriterClass(nw, wi, np.concatenate(loc), np.concatenate(can))
            for (nw, wi), (loc, can) in sorted(classes.items())
        )
        self._dtype = np.dtype((np.void, u))
        self._identity = (
            local_block_bytes == canonical_block_bytes
            and bool((full == np.arange(full.size)).all())
            and all(c.num_writers == 1 for c in self._classes)
        )

    @property
    def identity(self) -> bool:
        """The local row is the canonical row (one rank, no replication): plain copies."""
        return self._identity

    def _units(self, rows: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(rows).view(self._dtype)

    def store(self, canonical: np.ndarray, slots: np.ndarray, data: np.ndarray) -> int:
        """Writes this rank's bytes of `data` (`[n, local_block_bytes]` uint8) into rows
        `slots` of `canonical` (`[num_slots, canonical_block_bytes]` uint8, modified in
        place); `slots` are canonical page ids (writer rotation). Returns bytes written."""
        if self._identity:
            canonical[slots] = data
            return data.size
        dst = canonical.view(self._dtype)
        src = self._units(data)
        written = 0
        for c in self._classes:
            keep, rows = slots, src
            if c.num_writers > 1:
                mine = slots % c.num_writers == c.writer_index
                keep, rows = slots[mine], src[mine]
            if keep.size == 0:
                continue
            if c.local.size == src.shape[1] and (c.local == np.arange(c.local.size)).all():
                dst[keep[:, None], c.canonical[None, :]] = rows
            else:
                dst[keep[:, None], c.canonical[None, :]] = rows[:, c.local]
            written += keep.size * c.local.size * self.unit
        return written

    def load(self, canonical: np.ndarray, slots: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Reads rows `slots` of `canonical` into `out` (`[n, local_block_bytes]` uint8)."""
        if self._identity:
            return np.take(canonical, slots, axis=0, out=out)
        src = canonical.view(self._dtype)
        out.view(self._dtype)[...] = src[slots[:, None], self._load_index[None, :]]
        return out


def plan_for_group(
    mappings: Sequence[CanonicalPageMapping],
    local_pages: Sequence[int],
) -> CanonicalGroupPlan:
    """The plan for a group whose staging row holds `local_pages` bytes per layer (in
    order) and whose layers map with `mappings` (this rank's, same order)."""
    if len(mappings) != len(local_pages):
        raise TransferError(
            f"{len(mappings)} layer mappings for {len(local_pages)} layer pages; "
            "give one mapping per layer of the group, in staging order"
        )
    layers, lo, co = [], 0, 0
    for i, (m, page) in enumerate(zip(mappings, local_pages, strict=True)):
        if m.local_page_size_bytes != page:
            raise TransferError(
                f"layer {i}: the mapping expects a {m.local_page_size_bytes}-byte page but "
                f"the cache holds {page} bytes per block; padded pages are not certified"
            )
        layers.append((m, lo, co))
        lo += page
        co += m.canonical_page_size_bytes
    return CanonicalGroupPlan(layers, lo, co)


def group_layer_pages(
    layout: pk.KVLayout, shapes: Sequence[tuple[int, ...]], itemsize: int
) -> list[int]:
    """Bytes per block of each layer of a group's arrays (SEPARATE K, V arrays pair up)."""
    pages = [math.prod(layout.page_shape(tuple(s))) * itemsize for s in shapes]
    if layout.kv_stacking is pk.KVStacking.SEPARATE:
        if len(pages) % 2:
            raise TransferError(f"SEPARATE caches need K, V pairs; got {len(pages)} arrays")
        return [pages[i] + pages[i + 1] for i in range(0, len(pages), 2)]
    return pages


def canonical_block_bytes(mappings: Mapping[str, CanonicalPageMapping]) -> int:
    """Width of a canonical block row: the sum of the layers' canonical pages."""
    return sum(m.canonical_page_size_bytes for m in mappings.values())
