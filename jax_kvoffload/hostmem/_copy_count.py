"""The host bytes a pool memcpys: the CPU-checkable invariant of the accelerator path.

On an accelerator the KV bytes of a job should cross the bus once, by DMA, straight
between device memory and their final host slot (docs/kernels.md, "Data path"). Every
copy a pool makes with the CPU (numpy assignments into or out of its rows) is counted
here, per direction, so that tests on CPU can assert the count of a job on the code path
an accelerator takes: zero for pinned pools whose rows the DMA writes and reads, exactly
the documented number elsewhere. A change that adds a host copy fails such a test.

Cheap: one lock and an int add per pool call (per run of slots, never per byte).
"""

from __future__ import annotations

import threading

__all__ = ["HostCopies"]


class HostCopies:
    """Counters of the host bytes a pool copied, one per direction.

    Attributes:
      stored: bytes copied into the rows (stores; tier promotions are not counted:
        they fill a row the tier hands out, `chunk_row_for_write`).
      loaded: bytes copied out of the rows into load staging.
    """

    __slots__ = ("_lock", "loaded", "stored")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stored = 0
        self.loaded = 0

    def add(self, nbytes: int, *, store: bool) -> None:
        """Counts `nbytes` copied by the CPU in one direction."""
        with self._lock:
            if store:
                self.stored += int(nbytes)
            else:
                self.loaded += int(nbytes)

    @property
    def total(self) -> int:
        return self.stored + self.loaded

    def snapshot(self) -> tuple[int, int]:
        """(stored, loaded) now."""
        with self._lock:
            return self.stored, self.loaded

    def __repr__(self) -> str:
        return f"HostCopies(stored={self.stored}, loaded={self.loaded})"
