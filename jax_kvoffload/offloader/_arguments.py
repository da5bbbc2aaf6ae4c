"""The arguments of `KVOffloader`'s entry points against its fixed geometry: which group a
call names, and the chunk keys and block rows a `lookup`, `store` or `load` works on.

Checks and arithmetic only: nothing here changes a store, a job or a tier, and nothing
holds SIGINT, so the offloader runs it before the first step of a call that does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax

from jax_kvoffload.config import OffloadingConfig
from jax_kvoffload.hostmem.internals import check_index
from jax_kvoffload.offloader._cache_checks import check_dtype
from jax_kvoffload.offloader._checks import OffloaderError, check_hashes
from jax_kvoffload.offloader._chunking import chunk_hashes, chunks
from jax_kvoffload.store import OffloadKey, make_offload_key
from jax_kvoffload.transfer import GroupCaches
from jax_kvoffload.transfer.internals import check_distinct

__all__ = ["OffloaderArguments"]


class OffloaderArguments:
    """The groups, blocks per chunk and blocks per group of one offloader (fixed when it is
    built: `set_caches` keeps the shapes), and the checks of each call against them."""

    def __init__(self, config: OffloadingConfig, caches: Mapping[int, GroupCaches]) -> None:
        self._groups = {g.group_id: g for g in config.groups}
        self._num_blocks = {g: gc.num_blocks for g, gc in caches.items()}
        self._layouts = {g: gc.layout for g, gc in caches.items()}
        self._dtype = config.model.dtype
        self.bpc = config.cache.blocks_per_chunk
        if self.bpc < 1:
            raise OffloaderError(
                f"blocks_per_chunk={self.bpc}: 'block_size': 0 in the extra config gives "
                "chunks of no blocks; set 'blocks_per_chunk' >= 1"
            )

    @property
    def group_ids(self) -> list[int]:
        return list(self._groups)

    def group(self, group: int | None) -> int:
        """The group a call names; None means the only one."""
        if group is None:
            if len(self._groups) != 1:
                raise OffloaderError(f"pass group=; this config has groups {sorted(self._groups)}")
            return next(iter(self._groups))
        g = check_index("group", group)
        if g not in self._groups:
            raise OffloaderError(f"group {g} is not offloaded; groups are {sorted(self._groups)}")
        return g

    def window(self, g: int) -> int | None:
        """The group's sliding window in chunks (None: full attention)."""
        return self._groups[g].sliding_window_size_in_chunks

    def lookup_keys(self, g: int, block_hashes: Sequence[bytes]) -> list[OffloadKey]:
        """The keys of the whole chunks of a `lookup`."""
        return [make_offload_key(h, g) for h in chunk_hashes(check_hashes(block_hashes), self.bpc)]

    def store_chunks(
        self, g: int, block_hashes: Sequence[bytes], block_ids: Sequence[int]
    ) -> tuple[list[OffloadKey], list[list[int]], list[OffloadKey]]:
        """A `store`'s (chunk keys, each chunk's block ids, keys offered to the store):
        a sliding-window group offers only its last W chunks."""
        hashes, ids = chunks(block_hashes, block_ids, self.bpc, self._num_blocks[g], g)
        keys = [make_offload_key(h, g) for h in hashes]
        window = self.window(g)
        offered = keys if window is None else keys[max(0, len(keys) - window) :]
        # One chunk per key: the host store allocates one per key *offered* (vLLM's
        # scheduler never repeats one), and a second chunk under the same key would
        # stay write-pending for good.
        return keys, ids, list(dict.fromkeys(offered))

    def load_chunks(
        self, g: int, block_hashes: Sequence[bytes], block_ids: Sequence[int]
    ) -> tuple[list[OffloadKey], list[list[int]], int]:
        """A `load`'s (chunk keys, each chunk's block ids, chunks skipped before them): a
        sliding-window group of W chunks loads only the last W (and their blocks)."""
        hashes, ids = chunks(block_hashes, block_ids, self.bpc, self._num_blocks[g], g, unique=True)
        window = self.window(g)
        skipped = 0
        if window is not None:
            skipped = max(0, len(hashes) - window)
            hashes, ids = hashes[skipped:], ids[-window:]
        return [make_offload_key(h, g) for h in hashes], ids, skipped

    def check_set_caches(
        self, g: int, arrays: Sequence[jax.Array], others: Sequence[jax.Array]
    ) -> None:
        """New arrays for group `g`: the config's dtype, and no array shared with the
        other groups' (`others`). Anything not a list of arrays is left to the engine."""
        if isinstance(arrays, (list, tuple)) and all(isinstance(a, jax.Array) for a in arrays):
            for dtype in {a.dtype for a in arrays}:  # the config's, not just the width
                check_dtype(g, self._layouts[g], dtype, self._dtype)
            check_distinct([*others, *arrays], "set_caches (all groups)")
