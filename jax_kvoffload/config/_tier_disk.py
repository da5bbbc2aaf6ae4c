"""The disk tier's configuration (`{"type": "disk", ...}`; the tier: `tiers/_disk.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from jax_kvoffload.config._tier_options import TierOptions, set_checked
from jax_kvoffload.config._tier_values import (
    MAX_THREADS,
    TierConfigError,
    check_bool,
    check_int,
    check_path,
    check_seconds,
    check_size,
)

__all__ = ["DiskTierConfig"]

_DIRECT_IO = {True: "on", False: "off", "auto": "auto", "on": "on", "off": "off"}


@dataclass(frozen=True, kw_only=True)
class DiskTierConfig(TierOptions):
    """A crash-safe local-disk tier (docs/tiers.md).

    Attributes:
      path: directory of the tier; created 0700 if missing, refused if someone else owns
        it or it is group/other-accessible or a symbolic link.
      capacity_bytes: byte budget of the directory; least recently used entries go first.
      read_threads / write_threads: I/O threads; loads never queue behind stores.
      max_pending_store_bytes: store bytes queued before new stores are dropped.
      direct_io: "auto" (probe the filesystem), "on" (require O_DIRECT) or "off".
      fsync: make entries durable (file and directory fsync); entries are never wrong
        without it, but a power loss may lose recent ones.
      rescan_timeout_s: bound on the start-up scan that rebuilds the LRU index.
    """

    EXAMPLES: ClassVar = {"path": '"path": "/var/cache/jax-kvoffload"', "capacity_bytes": '"64GiB"'}

    path: str
    capacity_bytes: int
    # I/O threads mostly wait on the device (fsync latency, queue depth): more threads
    # than cores keep several writes in flight; vLLM's fs tier uses 16 of each.
    read_threads: int = 8
    write_threads: int = 8
    max_pending_store_bytes: int = 256 << 20
    direct_io: str = "auto"
    fsync: bool = True
    rescan_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        super().__post_init__()
        w = type(self).__name__
        set_checked(self, "path", check_path(w, "path", self.path))
        set_checked(self, "capacity_bytes", check_size(w, "capacity_bytes", self.capacity_bytes))
        for key in ("read_threads", "write_threads"):
            value = check_int(w, key, getattr(self, key), minimum=1, maximum=MAX_THREADS)
            set_checked(self, key, value)
        pending = check_size(w, "max_pending_store_bytes", self.max_pending_store_bytes)
        set_checked(self, "max_pending_store_bytes", pending)
        d = self.direct_io
        if isinstance(d, (bool, str)) and d in _DIRECT_IO:
            set_checked(self, "direct_io", _DIRECT_IO[d])
        else:
            raise TierConfigError(w, "direct_io", d, 'must be "auto", "on" or "off"')
        set_checked(self, "fsync", check_bool(w, "fsync", self.fsync))
        timeout = check_seconds(w, "rescan_timeout_s", self.rescan_timeout_s)
        set_checked(self, "rescan_timeout_s", timeout)
