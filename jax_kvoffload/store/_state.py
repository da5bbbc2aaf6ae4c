"""The host store's chunk accounting: the one mutable record `HostStore` and the parts
it owns (`LoadPath`, `StoreReporting`) share.

Plain fields on a slotted object: the store's hot paths read and bump them as they
would their own attributes. One scheduler thread (the store is not thread-safe).
"""

from __future__ import annotations

import dataclasses

from ._keys import OffloadKey

__all__ = ["StoreState"]


@dataclasses.dataclass(slots=True, eq=False)
class StoreState:
    """How the chunks of one store stand, and what it recorded since the last drain.

    Its identity also tags the store's request-access state in a context
    (``access_state``): a context seen by another store, or before a reset, starts afresh.

    Attributes:
      num_chunks: Chunks in the pool (fixed).
      num_allocated: High-water mark of fresh chunk ids.
      free_list: Freed chunk ids, reused last-in first-out.
      num_evictable: Chunks with ``ref_cnt == 0`` (readable, idle).
      num_write_pending: Chunks with ``ref_cnt == -1`` (a store in flight).
      generation: Bumped by ``reset_cache``.
      events: ``(keys, removed, metadata_only)`` per event not yet taken; None when
        events are off.
      allocation_sizes: Chunks allocated per ``prepare_store`` since the last stats.
      stores_skipped: Keys the store threshold kept out since the last stats.
    """

    num_chunks: int
    events: list[tuple[tuple[OffloadKey, ...], bool, bool]] | None
    num_allocated: int = 0
    free_list: list[int] = dataclasses.field(default_factory=list)
    num_evictable: int = 0
    num_write_pending: int = 0
    generation: int = 0
    allocation_sizes: list[int] = dataclasses.field(default_factory=list)
    stores_skipped: int = 0
