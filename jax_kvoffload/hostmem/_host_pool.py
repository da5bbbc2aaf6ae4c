"""Pre-allocated host memory for offloaded chunks, one row per chunk id and group.

A chunk of group g holds `blocks_per_chunk` consecutive blocks of every array (layer) of
the group, block-major, exactly as the gather kernel lays them out: row bytes =
`blocks_per_chunk * bytes_per_block[g]`. All rows exist from construction on, so memory
use is fixed and a store never allocates.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from jax_kvoffload.config.internals import checked_arguments
from jax_kvoffload.hostmem._indices import check_index
from jax_kvoffload.hostmem._pool_base import HostPool, HostPoolError
from jax_kvoffload.hostmem._strided import copy_rows

__all__ = ["HostChunkPool", "HostPoolError"]


@checked_arguments
class HostChunkPool(HostPool):
    """`num_chunks` rows per group of raw bytes (numpy uint8, host memory), allocated
    once: every store copies its blocks into them (one host copy after the D2H).

    With `buffer` (a 1-D uint8 array of at least `nbytes_for(...)` bytes, e.g. a
    `SharedHostRegion`) the rows are views of it instead of fresh memory.

    Threading and buffers: the `HostPool` contract (rows are plain memory; `write_blocks`
    copies its data).
    """

    moves_shards = True

    def __init__(
        self,
        num_chunks: int,
        bytes_per_block: Mapping[int, int],
        blocks_per_chunk: int,
        *,
        prefault: bool = False,
        buffer: np.ndarray | None = None,
    ) -> None:
        self._set_shape(num_chunks, bytes_per_block, blocks_per_chunk)
        num_chunks, blocks_per_chunk = self.num_chunks, self.blocks_per_chunk
        # np.zeros maps zero pages lazily; prefault touches them now so that the first
        # stores do not pay page faults (worth it for long-running servers).
        if buffer is None:
            try:
                self._rows = {
                    g: np.zeros((num_chunks, blocks_per_chunk * b), dtype=np.uint8)
                    for g, b in self.bytes_per_block.items()
                }
            except (ValueError, MemoryError):  # "Maximum allowed dimension exceeded", OOM
                need = self.nbytes_for(num_chunks, self.bytes_per_block, blocks_per_chunk)
                raise HostPoolError(
                    f"num_chunks={num_chunks} x blocks_per_chunk={blocks_per_chunk} x "
                    f"bytes_per_block={self.bytes_per_block} needs {need} bytes of host "
                    "memory: lower num_chunks (or blocks_per_chunk)"
                ) from None
        else:
            self._rows = self._carve(buffer)
        if prefault and buffer is None:  # never clear memory other processes share
            for rows in self._rows.values():
                rows.fill(0)

    @staticmethod
    def nbytes_for(num_chunks: int, bytes_per_block: Mapping[int, int], bpc: int) -> int:
        """Bytes a pool of this shape needs (the size of a `buffer` to build it over)."""
        return num_chunks * bpc * sum(bytes_per_block.values())

    def _carve(self, buffer: np.ndarray) -> dict[int, np.ndarray]:
        # Groups one after another, in the order given: every process that builds the
        # pool from the same arguments over a shared buffer sees the same rows.
        need = self.nbytes_for(self.num_chunks, self.bytes_per_block, self.blocks_per_chunk)
        ok = buffer.dtype == np.uint8 and buffer.ndim == 1 and buffer.size >= need
        if not ok or not buffer.flags.c_contiguous or not buffer.flags.writeable:
            # A strided buffer would make reshape copy: rows in private memory, silently.
            raise HostPoolError(
                f"buffer must be 1-D, contiguous, writable uint8 of at least {need} bytes; "
                f"got {buffer.dtype} {buffer.shape} strides {buffer.strides}"
            )
        rows, at = {}, 0
        for g, b in self.bytes_per_block.items():
            n = self.num_chunks * self.blocks_per_chunk * b
            rows[g] = buffer[at : at + n].reshape(self.num_chunks, self.blocks_per_chunk * b)
            at += n
        return rows

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._rows.values())

    def rows(self, group: int) -> np.ndarray:
        """The `[num_chunks, row_bytes]` array of a group (a view, not a copy)."""
        try:
            return self._rows[check_index("group", group)]
        except KeyError:
            raise HostPoolError(
                f"group {group} has no host rows; groups are {sorted(self._rows)}"
            ) from None

    def chunk_row(self, group: int, chunk: int) -> np.ndarray:
        """The row itself (a view)."""
        row: np.ndarray = self.rows(group)[self._chunk(chunk)]
        return row

    def chunk_row_for_write(self, group: int, chunk: int) -> np.ndarray:
        """The row itself (a view): filling it stores the chunk."""
        row: np.ndarray = self.rows(group)[self._chunk(chunk)]
        return row

    def _chunk(self, chunk: object) -> int:
        c = check_index("chunk", chunk)
        if not 0 <= c < self.num_chunks:
            raise HostPoolError(f"chunk {c} is outside [0, {self.num_chunks})")
        return c

    def flat(self, group: int) -> np.ndarray:
        """The group's rows as `[num_chunks * blocks_per_chunk, bytes_per_block]` (a view)."""
        rows = self.rows(group)
        return rows.reshape(self.num_chunks * self.blocks_per_chunk, self.bytes_per_block[group])

    def _leading(self, group: int, name: str, rows: np.ndarray, n: int | None = None) -> np.ndarray:
        """The group's slots cut to the width of `rows` (`[n, w]` uint8, w <= the slot)."""
        flat = self.flat(group)
        width = rows.shape[1] if rows.ndim == 2 else -1
        if (
            rows.dtype != np.uint8
            or not 0 < width <= flat.shape[1]
            or (n is not None and rows.shape[0] != n)
        ):
            raise HostPoolError(
                f"{name} must be [{'n' if n is None else n}, w] uint8 with 0 < w <= "
                f"{flat.shape[1]} (the group's bytes per block); got {rows.dtype} {rows.shape}"
            )
        return flat if width == flat.shape[1] else flat[:, :width]

    def write_blocks(self, group: int, chunk_ids: list[int], first: int, data: np.ndarray) -> None:
        """Writes `data` ([n_blocks, w] uint8) into the leading w bytes of consecutive
        block slots (w <= bytes_per_block; the rest of each slot is left as it is),
        starting at slot `first` of chunk `chunk_ids[0]` (a chunk list may start and end
        mid-chunk)."""
        dst = self._leading(group, "data", data)
        slots = self.slots(chunk_ids, first, data.shape[0])
        copy_rows(dst, slots, data, np.arange(slots.size), 1)
        self.host_copies.add(data.nbytes, store=True)

    def move_shards(
        self,
        group: int,
        chunk_ids: list[int],
        first: int,
        shape: tuple[int, ...],
        dtype: np.dtype,
        shards: list[tuple[tuple[slice, ...], np.ndarray]],
        *,
        store: bool,
    ) -> None:
        """Copies the blocks of a staging array of `shape` (`[n, *page]`, `dtype`), given
        as shards `(index, data)` with `data` = `staging[index]` (the block axis whole),
        between the shards and their places in the rows: into the rows (`store`), or from
        them into each `data`. One host pass instead of assembling the array first."""
        flat = self.flat(group)
        rows = flat.view(dtype).reshape(flat.shape[0], *shape[1:])
        slots = self.slots(chunk_ids, first, shape[0])
        blocks = np.arange(shape[0])
        for index, data in shards:
            place = rows[(slice(None), *index[1:])]
            if store:
                copy_rows(place, slots, data, blocks, 1)
            else:
                copy_rows(data, blocks, place, slots, 1)
            self.host_copies.add(data.nbytes, store=store)

    def read_blocks(
        self, group: int, chunk_ids: list[int], first: int, n_blocks: int, out: np.ndarray
    ) -> np.ndarray:
        """Reads the leading w bytes of `n_blocks` block slots starting at slot `first`
        into `out` (`[n_blocks, w]` uint8, w <= bytes_per_block)."""
        # Slices per run of consecutive slots: np.take(out=...) would stage through a
        # temporary (measured 2-3x slower for 64 MiB on the 2-core CI machine).
        src = self._leading(group, "out", out, n_blocks)
        slots = self.slots(chunk_ids, first, n_blocks)
        copy_rows(out, np.arange(n_blocks), src, slots, 1)
        self.host_copies.add(out.nbytes, store=False)
        return out
