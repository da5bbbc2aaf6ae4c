"""The reuse tracker behind ``store_threshold`` (vLLM's ``cpu/manager.py``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ._keys import OffloadKey

__all__ = ["ReuseTracker"]


class ReuseTracker:
    """Counts how often each key was offered for storing, bounded in size.

    An offer moves each tracked key to the most recent end and counts it; it inserts
    untracked keys with count 1, evicting the oldest tracked entry when full. Keys of
    the offer itself are never evicted by it: when only they remain, a new key is
    simply not tracked.

    Args:
      max_size: The most keys tracked at once (vLLM ``max_tracker_size``).
    """

    __slots__ = ("counts", "max_size")

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        # Ordered oldest first, so the eviction victim is popped in O(1).
        self.counts: OrderedDict[OffloadKey, int] = OrderedDict()

    def record_offer(self, keys: Sequence[OffloadKey]) -> None:
        """Counts one offer of ``keys``."""
        counts = self.counts
        protected: set[OffloadKey] = set()
        for key in keys:
            if key in counts:
                counts.move_to_end(key)
                counts[key] += 1
                protected.add(key)
        # Entries older than every key of this offer: the only ones it may evict.
        num_unprotected = len(counts) - len(protected)
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_size:
                if num_unprotected == 0:
                    continue
                counts.popitem(last=False)
                num_unprotected -= 1
            counts[key] = 1

    def count(self, key: OffloadKey) -> int:
        """Returns how often ``key`` was offered while tracked (0 if untracked)."""
        return self.counts.get(key, 0)
