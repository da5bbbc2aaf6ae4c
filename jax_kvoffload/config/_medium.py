"""Where KV bytes are: the one `Medium` of this library.

A chunk can be in four places: the device caches, the host rows, a disk tier, a remote
(shared) tier. The store's events name the medium of the tier whose keys changed (the
host store's are always `HOST`, vLLM's `Medium.CPU`); a transfer path names a source and
a destination (`transfer.TransferPath`: device -> host for a store, host -> disk for a
cascade). Defined here, at the bottom of the layers, because store and transfer both use
it and never import each other; each re-exports it.
"""

from __future__ import annotations

import enum

__all__ = ["Medium"]


class Medium(enum.Enum):
    """Where bytes live (vLLM's `Medium` and `LoadStoreSpec.medium()` in one enum).

    `CPU` is vLLM's name for `HOST` (an alias: `Medium.CPU is Medium.HOST`), so an
    event reads as vLLM's does: `OffloadingEvent(keys, Medium.CPU, ...)`.
    """

    DEVICE = "device"  # the engine's KV cache arrays (HBM, or host memory on CPU)
    HOST = "host"  # the host pool's rows (the host store's chunks)
    DISK = "disk"  # a local disk tier
    REMOTE = "remote"  # a shared tier on another machine (Redis protocol, Mooncake)
    CPU = "host"  # vLLM's name for HOST
