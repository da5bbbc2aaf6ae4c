"""A host pool whose rows are the host arrays `jax.device_put` returned: no host copy.

`HostChunkPool` pre-allocates numpy rows, so a store's device-to-host copy lands in a
(pinned) staging array that numpy then copies into the row: one host memcpy per byte
stored, and a load copies the row once more into its staging. `PinnedRowPool` keeps the
staging array itself as the chunk's row, as tpu-inference keeps the `pinned_host` arrays
of its KV swaps, and hands that same array back to a load (`row_sources`), which copies
it host-to-device straight from pinned memory: on the hot path no KV byte is copied by
the CPU in either direction (`host_copies` stays 0; tests/transfer/test_host_copies.py).
Tier cascades and `chunk_row` read the array through `np.asarray`, in place on CPU
(zero-copy, read-only; docs/architecture.md), made once per row and only when asked.

The price: memory is not reserved up front (XLA allocates each staging array; freed
when the chunk's row is replaced), and a store is split into one staging array per whole
chunk (the transfer engine does that for pools with `adopts_rows`), so that a row never
keeps a larger array alive than itself. `benchmarks/pools.py` times both pools.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jax_kvoffload.hostmem._indices import check_index
from jax_kvoffload.hostmem._pool_base import HostPool, HostPoolError

__all__ = ["PinnedRowPool"]

_ALIGN = 64  # XLA:CPU adopts (does not copy) 64-byte aligned numpy buffers in device_put


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    offset = -raw.ctypes.data % _ALIGN
    return raw[offset : offset + nbytes]


class PinnedRowPool(HostPool):
    """`num_chunks` rows per group, each the host array of the store that wrote it.

    A store covering a whole chunk at full width is adopted: the chunk's row becomes a
    view of the caller's array (the engine passes `np.asarray` of the `pinned_host`
    array `device_put` returned). Anything less (a store starting mid-chunk, narrower
    than a block) is copied into a row of the chunk's own, keeping the other bytes, as
    `HostChunkPool` does. A chunk never written reads as zeros.

    Threading and buffers: the `HostPool` contract; adopted arrays are never written
    (promotions get a fresh row from `chunk_row_for_write`).
    """

    adopts_rows = True

    def __init__(
        self, num_chunks: int, bytes_per_block: Mapping[int, int], blocks_per_chunk: int
    ) -> None:
        self._set_shape(num_chunks, bytes_per_block, blocks_per_chunk)
        num_chunks, blocks_per_chunk = self.num_chunks, self.blocks_per_chunk
        # Slot lists, one entry per chunk: a [bpc, bytes_per_block] uint8 array or None.
        # Threads write distinct entries (the HostPool contract); a list item assignment
        # is atomic under the GIL.
        self._rows: dict[int, list[np.ndarray | None]] = {
            g: [None] * num_chunks for g in self.bytes_per_block
        }
        # Adopted host arrays (`adopt_blocks`), viewed as rows only when asked.
        self._sources: dict[int, list[object | None]] = {
            g: [None] * num_chunks for g in self.bytes_per_block
        }
        self.adopted = 0  # chunks whose row is a caller's array (counters for tests)
        self.copied = 0  # chunk pieces copied into a row of their own

    @property
    def nbytes(self) -> int:
        """The most host memory the rows take (every chunk written)."""
        return self.num_chunks * self.blocks_per_chunk * sum(self.bytes_per_block.values())

    @property
    def held_bytes(self) -> int:
        """Host memory the rows keep alive now (distinct arrays behind them)."""
        seen: dict[int, int] = {}
        for g, rows in self._rows.items():
            for row, source in zip(rows, self._sources[g], strict=True):
                if source is not None:
                    seen[id(source)] = int(getattr(source, "nbytes", 0))
                elif row is not None:
                    base = row
                    while isinstance(base.base, np.ndarray):
                        base = base.base
                    seen[id(base)] = base.nbytes
        return sum(seen.values())

    def _group_rows(self, group: object) -> tuple[int, list[np.ndarray | None]]:
        g = self._check_group(group)
        return g, self._rows[g]

    def _row(self, g: int, chunk: int) -> np.ndarray | None:
        """The chunk's row as `[bpc, bytes_per_block]` uint8 (None: never written); an
        adopted source is viewed through `np.asarray` here, once."""
        row = self._rows[g][chunk]
        if row is None:
            source = self._sources[g][chunk]
            if source is not None:
                row = np.asarray(source).reshape(self.blocks_per_chunk, -1).view(np.uint8)
                self._rows[g][chunk] = row
        return row

    def adopt_blocks(
        self, group: int, chunk_ids: list[int], first: int, data: np.ndarray | None, source: object
    ) -> None:
        """`write_blocks` of the bytes of `source`, a host array of a store's staging
        (`[n, arrays, *page]`, read by `np.asarray` only when needed). A store of exactly
        one whole chunk at full width keeps `source` itself as the row: no host copy,
        and loads get it back from `row_sources`. `data` may be None then (it is read
        from `source` only for the stores that copy)."""
        g = self._check_group(group)
        bpc = self.blocks_per_chunk
        n = int(getattr(source, "shape", (0,))[0])
        whole = n == bpc and first % bpc == 0
        if whole and getattr(source, "nbytes", -1) == bpc * self.bytes_per_block[g]:
            chunk = int(self.slots(chunk_ids, first, bpc)[0]) // bpc
            self._sources[g][chunk] = source  # the caller's array is the row from now on
            self._rows[g][chunk] = None  # viewed on demand (`_row`)
            self.adopted += 1
            return
        if data is None:
            data = np.asarray(source).reshape(n, -1).view(np.uint8)
        self.write_blocks(g, chunk_ids, first, data)

    def write_blocks(self, group: int, chunk_ids: list[int], first: int, data: np.ndarray) -> None:
        g, rows = self._group_rows(group)
        width = self._check_rows(g, "data", data)
        bpc, full = self.blocks_per_chunk, self.bytes_per_block[g]
        for chunk, k0, k1, at in self._spans(chunk_ids, first, data.shape[0]):
            piece = data[at : at + k1 - k0]
            if k0 == 0 and k1 == bpc and width == full and piece.flags.c_contiguous:
                rows[chunk] = piece  # the caller's array is the row from now on
                self._sources[g][chunk] = None
                self.adopted += 1
                continue
            row = self._row(g, chunk)
            own = _aligned(bpc * full).reshape(bpc, full)
            if row is None:
                own.fill(0)
            else:
                own[...] = row  # keep the bytes this store does not cover
                self.host_copies.add(own.nbytes, store=True)
            own[k0:k1, :width] = piece
            self.host_copies.add(piece.nbytes, store=True)
            rows[chunk] = own
            self._sources[g][chunk] = None
            self.copied += 1

    def read_blocks(
        self, group: int, chunk_ids: list[int], first: int, n_blocks: int, out: np.ndarray
    ) -> np.ndarray:
        g, _ = self._group_rows(group)
        width = self._check_rows(g, "out", out, n_blocks)
        for chunk, k0, k1, at in self._spans(chunk_ids, first, n_blocks):
            row = self._row(g, chunk)
            if row is None:
                out[at : at + k1 - k0] = 0
            else:
                out[at : at + k1 - k0] = row[k0:k1, :width]
        self.host_copies.add(out.nbytes, store=False)
        return out

    def row_sources(
        self, group: int, chunk_ids: list[int], first: int, n_blocks: int
    ) -> list[tuple[object, int, int]]:
        """What a load copies to the device, without a host copy: `(row, k0, k1)` per
        chunk touched, in slot order, the load wanting slots `[k0, k1)` of `row`.
        `row` is the adopted source (a host jax array: `[bpc, arrays, *page]`) or the
        chunk's own `[bpc, bytes_per_block]` uint8 row (zeros if never written)."""
        g, _ = self._group_rows(group)
        out: list[tuple[object, int, int]] = []
        for chunk, k0, k1, _at in self._spans(chunk_ids, first, n_blocks):
            source = self._sources[g][chunk]
            if source is None:
                source = self._row(g, chunk)
            if source is None:
                source = np.zeros((self.blocks_per_chunk, self.bytes_per_block[g]), np.uint8)
            out.append((source, k0, k1))
        return out

    def chunk_row(self, group: int, chunk: int) -> np.ndarray:
        """The chunk's row as 1-D bytes: a view of the adopted array (no copy)."""
        g, _ = self._group_rows(group)
        row = self._row(g, self._chunk(chunk))
        if row is None:
            return np.zeros(self.row_bytes(g), dtype=np.uint8)
        return row.reshape(-1)

    def chunk_row_for_write(self, group: int, chunk: int) -> np.ndarray:
        """A fresh row, installed now (the chunk is write-pending: nobody reads it)."""
        g, rows = self._group_rows(group)
        c = self._chunk(chunk)
        own = _aligned(self.row_bytes(g))
        rows[c] = own.reshape(self.blocks_per_chunk, self.bytes_per_block[g])
        self._sources[g][c] = None
        return own

    def _chunk(self, chunk: object) -> int:
        c = check_index("chunk", chunk)
        if not 0 <= c < self.num_chunks:
            raise HostPoolError(f"chunk {c} is outside [0, {self.num_chunks})")
        return c
