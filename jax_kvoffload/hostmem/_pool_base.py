"""The abstract host pool: where offloaded chunks live in host memory.

Every pool the transfer engine, vLLM's worker or the secondary tiers use implements
`HostPool`; nothing of ours asks a pool what it can do with `hasattr`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import ClassVar

import numpy as np

from jax_kvoffload.errors import KVOffloadTypeError, KVOffloadValueError
from jax_kvoffload.hostmem._copy_count import HostCopies
from jax_kvoffload.hostmem._indices import check_index, check_indices

__all__ = ["HostPool", "HostPoolError"]

_MAX_BYTES = 2**63 - 1


class HostPoolError(KVOffloadValueError):
    """A chunk id or row is outside the pool."""


class HostPool(ABC):
    """Host memory for `num_chunks` chunks of every group.

    Geometry (set by implementations, fixed for the pool's life):

    - `num_chunks`, `blocks_per_chunk`; `bytes_per_block[g]`: the bytes this process
      moves per block of group g (a canonical view: its local page; vLLM's worker: the
      tensor's widest unpadded page). `nbytes`: the host memory the pool may hold.
    - Block slot `s` of a chunk list is block `s % blocks_per_chunk` of chunk
      `chunk_ids[s // blocks_per_chunk]`; a chunk id addresses a row in every group (as
      vLLM sizes its CPU tier), and a group's row of a chunk holds its `blocks_per_chunk`
      blocks back to back: `row_bytes(g) = blocks_per_chunk * bytes_per_block[g]`.

    Contract:

    - **Who writes what, when.** `write_blocks` runs on the store worker thread after
      the device-to-host copy; `read_blocks` on the load worker thread before the
      host-to-device copy; `chunk_row` / `chunk_row_for_write` on the threads of a
      secondary tier (cascades read a row, promotions fill one). The pool does no
      locking: callers guarantee that no two jobs in flight touch one chunk with a
      write among them (the host store pins chunks being read and never hands a pinned
      or write-pending chunk to a store; the transfer engine fences rows across
      directions; a reset waits for tier I/O). Calls for different chunks may run
      concurrently.
    - **Buffers.** `write_blocks` either copies `data` or keeps it (`adopts_rows`):
      the caller must not change `data` afterwards. `read_blocks` fills `out`.
    - **Rows for tiers.** `chunk_row(g, c)` is the group's whole row of chunk c as 1-D
      uint8, zero-copy where the pool can; valid until the chunk is written again (the
      caller pins it). `chunk_row_for_write(g, c)` is a writable 1-D buffer of the same
      length that *is* the chunk's row once filled (the chunk must be write-pending).
    - **Shards.** Pools with `moves_shards` copy each shard of a sharded staging array
      straight between the shard and its place in the rows (`move_shards`); others get
      the assembled array through `write_blocks` / `read_blocks`.
    - **Host copies.** `host_copies` counts the bytes the pool copies with the CPU, per
      direction (`HostCopies`): `write_blocks`, `read_blocks` and `move_shards` of a pool
      that copies count every byte they move; a pool whose rows the DMA writes and reads
      (`PinnedRowPool`'s adopted rows, vLLM's pinned slots) counts none of them.
    """

    #: Copies shards of a sharded staging array in place (`move_shards`).
    moves_shards: ClassVar[bool] = False
    #: `write_blocks` keeps the caller's array as the rows (no host copy).
    adopts_rows: ClassVar[bool] = False

    num_chunks: int
    blocks_per_chunk: int
    bytes_per_block: Mapping[int, int]
    host_copies: HostCopies

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of host memory the pool holds (adopting pools: at most)."""

    @abstractmethod
    def write_blocks(self, group: int, chunk_ids: list[int], first: int, data: np.ndarray) -> None:
        """Stores `data` (`[n, w]` uint8, `0 < w <= bytes_per_block[group]`) in n
        consecutive block slots from slot `first`; the rest of each slot is unchanged."""

    @abstractmethod
    def read_blocks(
        self, group: int, chunk_ids: list[int], first: int, n_blocks: int, out: np.ndarray
    ) -> np.ndarray:
        """Reads the leading w bytes of `n_blocks` slots from slot `first` into `out`
        (`[n_blocks, w]` uint8) and returns it."""

    @abstractmethod
    def chunk_row(self, group: int, chunk: int) -> np.ndarray:
        """The group's row of `chunk` (`row_bytes(group)` uint8, read-only use)."""

    @abstractmethod
    def chunk_row_for_write(self, group: int, chunk: int) -> np.ndarray:
        """A writable `row_bytes(group)` buffer that is the chunk's row once filled."""

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
        """Copies shards of a staging array between the shards and the rows (pools
        with `moves_shards` only)."""
        raise NotImplementedError(f"{type(self).__name__} does not move shards")

    def adopt_blocks(
        self, group: int, chunk_ids: list[int], first: int, data: np.ndarray | None, source: object
    ) -> None:
        """`write_blocks` of a store's host staging `source` that the pool may keep as
        its rows (pools with `adopts_rows` only; `data`: its bytes, or None)."""
        raise NotImplementedError(f"{type(self).__name__} does not adopt rows")

    def row_sources(
        self, group: int, chunk_ids: list[int], first: int, n_blocks: int
    ) -> list[tuple[object, int, int]]:
        """The rows a load copies to the device as they are, `(row, k0, k1)` per chunk
        (pools with `adopts_rows` only)."""
        raise NotImplementedError(f"{type(self).__name__} does not hand out its rows")

    def store_bytes(
        self, group: int, chunk_ids: list[int], first: int, n_blocks: int
    ) -> int | None:
        """Bytes this process writes when storing `n_blocks` blocks there, when that
        is not every byte of the blocks (a canonical view's writer rotation); None
        means the plain count."""
        return None

    def row_bytes(self, group: int) -> int:
        """Bytes of one chunk's row in `group`."""
        return self.blocks_per_chunk * self.bytes_per_block[group]

    def check_chunks(self, chunk_ids: list[int]) -> None:
        """Raises `HostPoolError` for chunk ids outside `[0, num_chunks)`."""
        ids = check_indices("chunk_ids", chunk_ids)
        bad = ids[(ids < 0) | (ids >= self.num_chunks)].tolist()
        if bad:
            raise HostPoolError(f"chunk ids {bad[:8]} are outside [0, {self.num_chunks})")

    def _set_shape(
        self, num_chunks: object, bytes_per_block: object, blocks_per_chunk: object
    ) -> None:
        """Checks and sets `num_chunks`, `bytes_per_block`, `blocks_per_chunk` (every
        pool's constructor starts here)."""
        num_chunks = check_index("num_chunks", num_chunks)
        blocks_per_chunk = check_index("blocks_per_chunk", blocks_per_chunk)
        if num_chunks < 0:
            raise HostPoolError(f"num_chunks must be >= 0, got {num_chunks}")
        if blocks_per_chunk < 1:
            raise HostPoolError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        if not isinstance(bytes_per_block, Mapping):
            raise KVOffloadTypeError(
                f"bytes_per_block must be a mapping group id -> bytes, got "
                f"{type(bytes_per_block).__name__} {bytes_per_block!r:.40}; pass e.g. {{0: 4096}}"
            )
        widths = {}
        for g, b in bytes_per_block.items():
            width = check_index(f"bytes_per_block[{g!r}]", b)
            if width < 1:
                raise HostPoolError(f"bytes_per_block[{g!r}]={width} must be >= 1")
            widths[check_index("group id", g)] = width
        row = blocks_per_chunk * sum(widths.values())
        if num_chunks * row > _MAX_BYTES:  # numpy, mmap and the OS index bytes as int64
            raise HostPoolError(
                f"num_chunks={num_chunks} x blocks_per_chunk={blocks_per_chunk} x "
                f"bytes_per_block={widths} is {num_chunks * row} bytes, past int64: lower "
                "num_chunks, blocks_per_chunk or bytes_per_block"
            )
        self.num_chunks = num_chunks
        self.blocks_per_chunk = blocks_per_chunk
        self.bytes_per_block = widths
        self.host_copies = HostCopies()

    def _spans(
        self, chunk_ids: list[int], first: int, n: int
    ) -> Iterator[tuple[int, int, int, int]]:
        """(chunk, first slot in it, end slot, first data row) per chunk touched.

        The whole range is checked (`slots`) before the first span is used: a negative
        `first` would index the chunk list from its end, and a range past it would fail
        after the slots before it were written."""
        bpc = self.blocks_per_chunk
        chunks = self.slots(chunk_ids, first, n) // bpc
        done = 0
        while done < n:
            slot = first + done
            chunk = int(chunks[done])
            k0 = slot % bpc
            k1 = min(bpc, k0 + n - done)
            yield chunk, k0, k1, done
            done += k1 - k0

    def _check_rows(self, g: int, name: str, rows: np.ndarray, n: int | None = None) -> int:
        """The width w of `rows` (`[n, w]` uint8, 0 < w <= the group's bytes per block)."""
        width = rows.shape[1] if rows.ndim == 2 else -1
        if (
            rows.dtype != np.uint8
            or not 0 < width <= self.bytes_per_block[g]
            or (n is not None and rows.shape[0] != n)
        ):
            raise HostPoolError(
                f"{name} must be [{'n' if n is None else n}, w] uint8 with 0 < w <= "
                f"{self.bytes_per_block[g]} (the group's bytes per block); got {rows.dtype} "
                f"{rows.shape}"
            )
        return width

    def slots(self, chunk_ids: list[int], first: int, n: int) -> np.ndarray:
        """Global slot numbers (`chunk * blocks_per_chunk + k`) of `n` consecutive
        block slots from slot `first` of the chunk list."""
        bpc = self.blocks_per_chunk
        ids = check_indices("chunk_ids", chunk_ids)
        first, n = check_index("first", first), check_index("n", n)
        # Checked here because numpy would read a negative index from the end: a write
        # would land silently in another chunk's row.
        if first < 0 or n < 0 or first + n > ids.size * bpc:
            raise HostPoolError(
                f"{n} blocks from slot {first} do not fit the {ids.size} chunk(s) given "
                f"({bpc} slots each); need 0 <= first and first + n <= {ids.size * bpc}"
            )
        k = np.arange(first, first + n)
        chunks = ids[k // bpc]
        if chunks.size and (chunks.min() < 0 or chunks.max() >= self.num_chunks):
            bad = chunks[(chunks < 0) | (chunks >= self.num_chunks)]
            raise HostPoolError(f"chunk ids {bad[:8].tolist()} are outside [0, {self.num_chunks})")
        return chunks * bpc + k % bpc

    def _check_group(self, group: object) -> int:
        g = check_index("group", group)
        if g not in self.bytes_per_block:
            raise HostPoolError(
                f"group {g} has no host rows; groups are {sorted(self.bytes_per_block)}"
            )
        return g
