"""Which way a transfer moves bytes (vLLM's `LoadStoreSpec.medium()` pairs).

vLLM tags each side of a transfer with a medium and dispatches on the pair. Ours are
the places a KV chunk can be (`Medium`, defined in `config` for store and transfer
alike, re-exported here): a `TransferPath` is a (source, destination) pair;
`Direction.STORE` is device -> host, `LOAD` host -> device, a cascade host -> disk or
remote, a promotion the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass

from jax_kvoffload.config.internals import Medium

__all__ = ["Medium", "TransferPath"]


@dataclass(frozen=True)
class TransferPath:
    """Which way a transfer moves bytes: `source` -> `destination`."""

    source: Medium
    destination: Medium

    def __str__(self) -> str:
        return f"{self.source.value}->{self.destination.value}"
