"""A host pool laid out as vLLM's shared offload region: one row per chunk, all workers.

vLLM's CPU tier keeps chunk c at bytes `[c * row_stride, (c + 1) * row_stride)` of one
region that every worker and the scheduler map (`SharedOffloadRegion`), each worker's
bytes at `rank * cpu_page_size_per_worker` of the row. The scheduler's secondary tiers
store and fill whole rows (`primary_kv_view[c]`), so the workers must write there.
`ChunkRowPool` is this process's window on such a buffer: its rows of each group
(vLLM's worker: each KV tensor) sit back to back inside its area of every chunk row.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from numpy.lib.stride_tricks import as_strided

from jax_kvoffload.hostmem._indices import check_index
from jax_kvoffload.hostmem._pool_base import HostPool, HostPoolError

__all__ = ["ChunkRowPool"]


class ChunkRowPool(HostPool):
    """Rows of `row_stride` bytes per chunk in `buffer`; this process's area of each row
    starts at `area_offset` and holds, group after group (in the order given), the
    group's `blocks_per_chunk * bytes_per_block[g]` bytes.

    Threading and buffers: the `HostPool` contract (plain memory; `write_blocks` copies).
    Other processes (the scheduler's tiers, other workers) use other bytes of the rows
    or the same bytes under the same pins.
    """

    def __init__(
        self,
        buffer: np.ndarray,
        num_chunks: int,
        bytes_per_block: Mapping[int, int],
        blocks_per_chunk: int,
        *,
        row_stride: int,
        area_offset: int = 0,
    ) -> None:
        self._set_shape(num_chunks, bytes_per_block, blocks_per_chunk)
        row_stride = check_index("row_stride", row_stride)
        area_offset = check_index("area_offset", area_offset)
        area = self.blocks_per_chunk * sum(self.bytes_per_block.values())
        need = (self.num_chunks - 1) * row_stride + area_offset + area if self.num_chunks else 0
        if area_offset + area > row_stride:
            raise HostPoolError(
                f"this process's {area} bytes from offset {area_offset} do not fit a row of "
                f"{row_stride} bytes: size the rows from the same blocks per chunk and widths"
            )
        ok = buffer.dtype == np.uint8 and buffer.ndim == 1 and buffer.flags.c_contiguous
        if not ok or not buffer.flags.writeable or buffer.size < need or area_offset < 0:
            raise HostPoolError(
                f"buffer must be 1-D, contiguous, writable uint8 of at least {need} bytes "
                f"({self.num_chunks} rows of {row_stride}, this area {area} bytes from "
                f"{area_offset}); got {buffer.dtype} {buffer.shape}"
            )
        self._buffer = buffer
        self._rows: dict[int, np.ndarray] = {}  # group -> [num_chunks, bpc, width] view
        at = area_offset
        for g, width in self.bytes_per_block.items():
            self._rows[g] = as_strided(
                buffer[at:],
                shape=(self.num_chunks, self.blocks_per_chunk, width),
                strides=(row_stride, width, 1),
                writeable=True,
            )
            at += self.blocks_per_chunk * width

    @property
    def nbytes(self) -> int:
        return self.num_chunks * self.blocks_per_chunk * sum(self.bytes_per_block.values())

    def write_blocks(self, group: int, chunk_ids: list[int], first: int, data: np.ndarray) -> None:
        g = self._check_group(group)
        width, rows = self._check_rows(g, "data", data), self._rows[g]
        for chunk, k0, k1, at in self._spans(chunk_ids, first, data.shape[0]):
            rows[chunk, k0:k1, :width] = data[at : at + k1 - k0]
        self.host_copies.add(data.nbytes, store=True)

    def read_blocks(
        self, group: int, chunk_ids: list[int], first: int, n_blocks: int, out: np.ndarray
    ) -> np.ndarray:
        g = self._check_group(group)
        width, rows = self._check_rows(g, "out", out, n_blocks), self._rows[g]
        for chunk, k0, k1, at in self._spans(chunk_ids, first, n_blocks):
            out[at : at + k1 - k0] = rows[chunk, k0:k1, :width]
        self.host_copies.add(out.nbytes, store=False)
        return out

    def chunk_row(self, group: int, chunk: int) -> np.ndarray:
        """The group's bytes of the chunk's row (a view; contiguous)."""
        g = self._check_group(group)
        row: np.ndarray = self._rows[g][self._chunk(chunk)].reshape(-1)
        return row

    chunk_row_for_write = chunk_row

    def _chunk(self, chunk: object) -> int:
        c = check_index("chunk", chunk)
        if not 0 <= c < self.num_chunks:
            raise HostPoolError(f"chunk {c} is outside [0, {self.num_chunks})")
        return c
