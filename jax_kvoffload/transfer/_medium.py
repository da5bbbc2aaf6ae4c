"""Where bytes live, and which way a transfer moves them (vLLM's `LoadStoreSpec.medium()`).

vLLM tags each side of a transfer with a medium (`Medium.GPU`, `CPU`, `STORAGE`, ...)
and dispatches on the pair. Ours are the four places a KV chunk can be: the device
caches, the host rows, a disk tier, a remote (shared) tier. A `TransferPath` is a
(source, destination) pair; `Direction.STORE` is device -> host, `LOAD` host -> device,
a cascade host -> disk or remote, a promotion the reverse.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Medium", "TransferPath"]


class Medium(enum.Enum):
    DEVICE = "device"  # the engine's KV cache arrays (HBM, or host memory on CPU)
    HOST = "host"  # the host pool's rows
    DISK = "disk"  # a local disk tier
    REMOTE = "remote"  # a shared tier on another machine (Redis protocol)


@dataclass(frozen=True)
class TransferPath:
    """Which way a transfer moves bytes: `source` -> `destination`."""

    source: Medium
    destination: Medium

    def __str__(self) -> str:
        return f"{self.source.value}->{self.destination.value}"
