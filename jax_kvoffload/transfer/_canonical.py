"""Canonical relayout of one group's block rows: the host copy, done with strided views.

A rank's staging row for one block is its layers' pages back to back (the gather kernel's
output; `GroupCaches` order). The canonical block row is the layers' canonical pages back
to back, in the same layer order. `CanonicalGroupPlan` folds a rank's per-layer
`CanonicalPageMapping`s into a few strided families (`_strided.StridedCopy`), so a store
or a load is one strided numpy assignment per family and run of slots, in place of the
plain row copy the direct path makes between staging and pool rows. Writer rotation
(as vLLM's worker does): a rank stores a layer's bytes of canonical block `b` only when
`mapping.is_writer(b)`; loads read every block.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

import pallas_kernels as pk
from jax_kvoffload.config.canonical import CanonicalPageMapping, CopyRun, KVTensorView
from jax_kvoffload.hostmem.internals import StridedCopy, copy_rows, merge_copies
from jax_kvoffload.transfer._errors import TransferError


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


@dataclass(frozen=True)
class _WriterClass:
    num_writers: int
    writer_index: int
    copies: tuple[StridedCopy, ...]
    nbytes: int  # local bytes per block in this class


class CanonicalGroupPlan:
    """One rank's relayout of one group: local block rows <-> canonical block rows.

    The layers' runs become a few `StridedCopy` families (uniform layers fold into one), so
    a batch of blocks is one strided numpy assignment per family and slot segment: the
    relayout *is* the host copy between staging and pool rows, moving the same bytes as
    the direct path's plain row copy.

    Args:
      layers: per layer, in staging order, `(mapping, local_offset, canonical_offset)`:
        this rank's mapping and where the layer's page starts in the local staging row
        and in the canonical block row (bytes).
      local_block_bytes, canonical_block_bytes: row widths per block.
      padding: trailing bytes of the local row that no mapping covers (a padded page,
        e.g. vLLM's `page_size_bytes` over the unpadded page): never stored, and never
        written by loads (`out` keeps whatever the caller put there: vLLM's worker never
        touches the padding of a device page either).
    """

    def __init__(
        self,
        layers: Sequence[tuple[CanonicalPageMapping, int, int]],
        local_block_bytes: int,
        canonical_block_bytes: int,
        *,
        padding: int = 0,
    ) -> None:
        if not 0 <= padding <= local_block_bytes:
            raise TransferError(f"padding {padding} outside a {local_block_bytes}-byte row")
        self.local_block_bytes = local_block_bytes
        self.canonical_block_bytes = canonical_block_bytes
        self.padding = padding
        classes: dict[tuple[int, int], list[StridedCopy]] = {}
        local = np.zeros(local_block_bytes - padding, dtype=bool)
        canonical = np.zeros(canonical_block_bytes, dtype=bool)
        for i, (m, lo, co) in enumerate(layers):
            copies = classes.setdefault((m.num_writers, m.writer_index), [])
            for r in m.runs:
                _check_run(i, r, m, lo, co, local.size, canonical.size)
                copies.append(StridedCopy.of_run(r, lo, co))
                for lf, cf, n in r.fragments():
                    for name, seen, at in (
                        ("local", local, lo + lf),
                        ("canonical", canonical, co + cf),
                    ):
                        if seen[at : at + n].any():
                            raise TransferError(
                                f"layer {i}: {name} bytes [{at}, {at + n}) are mapped more "
                                "than once; every byte needs one place"
                            )
                        seen[at : at + n] = True
        if not local.all():
            raise TransferError(
                f"the layer mappings cover {int(local.sum())} of the {local.size} mapped "
                "bytes of a block row; every byte needs one place"
            )
        self._classes = tuple(
            _WriterClass(nw, wi, tuple(merged), sum(c.nbytes for c in merged))
            for (nw, wi), copies in sorted(classes.items())
            for merged in [merge_copies(copies)]
        )
        self._all = tuple(c for k in self._classes for c in k.copies)
        only = self._all[0] if len(self._all) == 1 else None
        self._identity = (
            only is not None
            and local_block_bytes == canonical_block_bytes == only.nbytes
            and only.local == only.canonical == 0
            and only.contiguous()
            and all(k.num_writers == 1 for k in self._classes)
            and padding == 0
        )

    def _rows(self, name: str, rows: np.ndarray, width: int) -> None:
        if rows.ndim != 2 or rows.shape[1] != width or rows.dtype != np.uint8:
            raise TransferError(
                f"{name} must be [n, {width}] uint8 rows; got {rows.dtype} {rows.shape}"
            )

    @property
    def identity(self) -> bool:
        """The local row is the canonical row (one rank, no replication): plain copies."""
        return self._identity

    @property
    def copies(self) -> tuple[StridedCopy, ...]:
        """The strided families, all writer classes together."""
        return self._all

    def store_bytes(self, slots: np.ndarray) -> int:
        """Bytes `store` writes for these canonical page ids (writer rotation applied)."""
        slots = np.asarray(slots, dtype=np.int64)
        total = 0
        for k in self._classes:
            mine = (
                slots.size
                if k.num_writers == 1
                else int(np.count_nonzero(slots % k.num_writers == k.writer_index))
            )
            total += mine * k.nbytes
        return total

    def store(
        self,
        canonical: np.ndarray,
        slots: np.ndarray,
        data: np.ndarray,
        page_ids: np.ndarray | None = None,
    ) -> int:
        """Writes this rank's bytes of `data` (`[n, local_block_bytes]` uint8) into rows
        `slots` of `canonical` (`[num_slots, canonical_block_bytes]` uint8, modified in
        place); `slots` are canonical page ids (writer rotation), unless `page_ids` (one
        per slot, consecutive) gives them apart (rows of one chunk of a larger pool).
        Returns bytes written."""
        slots = np.asarray(slots, dtype=np.int64)
        rotation = slots if page_ids is None else np.asarray(page_ids, dtype=np.int64)
        self._rows("canonical", canonical, self.canonical_block_bytes)
        self._rows("data", data, self.local_block_bytes)
        if self._identity:
            copy_rows(canonical, slots, data, np.arange(slots.size), 1)
            return data.size
        data = np.ascontiguousarray(data)
        positions = np.arange(slots.size)
        written = 0
        for k in self._classes:
            keep, pos, step = slots, positions, 1
            if k.num_writers > 1:
                mine = rotation % k.num_writers == k.writer_index
                keep, pos, step = slots[mine], positions[mine], k.num_writers
            if keep.size == 0:
                continue
            for c in k.copies:
                copy_rows(c.canonical_view(canonical), keep, c.local_view(data), pos, step)
            written += keep.size * k.nbytes
        return written

    def load(self, canonical: np.ndarray, slots: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Reads rows `slots` of `canonical` into `out` (`[n, local_block_bytes]` uint8)."""
        slots = np.asarray(slots, dtype=np.int64)
        self._rows("canonical", canonical, self.canonical_block_bytes)
        self._rows("out", out, self.local_block_bytes)
        if self._identity:
            copy_rows(out, np.arange(slots.size), canonical, slots, 1)
            return out
        positions = np.arange(slots.size)
        for c in self._all:
            copy_rows(c.local_view(out), positions, c.canonical_view(canonical), slots, 1)
        return out


def _check_run(
    layer: int,
    run: CopyRun,
    m: CanonicalPageMapping,
    lo: int,
    co: int,
    local_width: int,
    canonical_width: int,
) -> None:
    """Every fragment of `run` inside its layer's pages, and the pages inside the rows."""
    sizes = (run.fragment_size, run.num_fragments)
    offsets = (run.local_offset, run.canonical_offset, run.local_stride, run.canonical_stride)
    if min(sizes) < 1 or min(offsets) < 0:
        raise TransferError(f"layer {layer}: a run needs positive sizes and offsets: {run}")
    last = (run.num_fragments - 1, run.fragment_size)
    local_end = run.local_offset + last[0] * run.local_stride + last[1]
    canonical_end = run.canonical_offset + last[0] * run.canonical_stride + last[1]
    if local_end > m.local_page_size_bytes or canonical_end > m.canonical_page_size_bytes:
        raise TransferError(
            f"layer {layer}: a run reaches byte {local_end} of a {m.local_page_size_bytes}-"
            f"byte page and {canonical_end} of a {m.canonical_page_size_bytes}-byte "
            f"canonical page: {run}"
        )
    if lo + m.local_page_size_bytes > local_width or co + m.canonical_page_size_bytes > (
        canonical_width
    ):
        raise TransferError(
            f"layer {layer}: its pages at {lo} / {co} do not fit rows of {local_width} / "
            f"{canonical_width} bytes"
        )


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


def plan_for_padded_page(
    mapping: CanonicalPageMapping, page_bytes: int, canonical_bytes: int | None = None
) -> CanonicalGroupPlan:
    """The plan for one tensor whose block row is a `page_bytes` page of which the first
    `mapping.local_page_size_bytes` are mapped (vLLM's refs: padded vs unpadded page);
    `canonical_bytes` widens the canonical row (default: the mapping's page). Loads leave
    the padding of `out` as the caller filled it, as vLLM's worker leaves a device page's
    padding (our vLLM worker passes unpadded rows: `page_bytes` = the mapped page)."""
    local = mapping.local_page_size_bytes
    canonical = mapping.canonical_page_size_bytes if canonical_bytes is None else canonical_bytes
    if local > page_bytes or mapping.canonical_page_size_bytes > canonical:
        raise TransferError(
            f"a mapping of a {local}-byte page into {mapping.canonical_page_size_bytes} "
            f"canonical bytes does not fit a {page_bytes}-byte row and {canonical}-byte "
            "canonical row"
        )
    return CanonicalGroupPlan([(mapping, 0, 0)], page_bytes, canonical, padding=page_bytes - local)


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
