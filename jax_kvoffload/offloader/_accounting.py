"""The accounting behind `KVOffloader.stats()`: what the offloader counts itself.

The host store already counts chunk lookups, store outcomes and evictions
(`HostStore.counters()`); this adds what only the offloader sees: tokens per group,
`lookup` calls and the prefix they returned, and the transfer jobs it reported. Calls
come from the offloader's caller thread; `snapshot()` may come from any thread.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from jax_kvoffload.hostmem import HostCopies
from jax_kvoffload.stats import OffloadStats, TierSource, TransferTally, store_side
from jax_kvoffload.transfer import TransferResult

if TYPE_CHECKING:
    from jax_kvoffload.store import HostStore

__all__ = ["OffloaderAccounting"]


class OffloaderAccounting:
    """Counters of one `KVOffloader` (docs/observability.md).

    Args:
      store: the offloader's `HostStore` (read, never drained).
      tokens_per_block: group id -> tokens one block of the group spans.
      blocks_per_chunk: blocks per chunk.
      tiers: returns the secondary tiers' `TierStats` (the tier path's `summary`), or
        None without tiers.
      host_copies: the pool's `HostCopies` (the KV bytes it copied with the CPU).
    """

    def __init__(
        self,
        store: HostStore,
        tokens_per_block: Mapping[int, int],
        blocks_per_chunk: int,
        tiers: TierSource | None = None,
        host_copies: HostCopies | None = None,
    ) -> None:
        self._store = store
        self._tokens_per_block = dict(tokens_per_block)
        self._bpc = blocks_per_chunk
        self._lock = threading.Lock()
        self._hit_tokens = 0
        self._prefix_lookups = 0
        self._prefix_hit_tokens = 0
        self.transfers = TransferTally()
        self._tiers = tiers
        self._host_copies = host_copies

    def on_lookup(self, group: int, hit_chunks: int, prefix_blocks: int) -> None:
        """One `lookup` call: `hit_chunks` chunks answered HIT, `prefix_blocks` returned."""
        tokens = self._tokens_per_block[group]
        with self._lock:
            self._prefix_lookups += 1
            self._hit_tokens += hit_chunks * self._bpc * tokens
            self._prefix_hit_tokens += prefix_blocks * tokens

    def on_job(self, store: bool, result: TransferResult) -> None:
        """One reported `TransferResult` (`store`: its direction is device -> host)."""
        self.transfers.record(store, result.success, result.size_bytes, result.seconds)

    def snapshot(self) -> OffloadStats:
        with self._lock:
            hit_tokens, calls, prefix = (
                self._hit_tokens,
                self._prefix_lookups,
                self._prefix_hit_tokens,
            )
        store, load = self.transfers.totals()
        tiers = self._tiers() if self._tiers is not None else ()
        copied = (0, 0) if self._host_copies is None else self._host_copies.snapshot()
        return OffloadStats(
            **store_side(self._store, hit_tokens, tiers),
            prefix_lookups=calls,
            prefix_hit_tokens=prefix,
            store=store,
            load=load,
            host_copied_stored=copied[0],
            host_copied_loaded=copied[1],
        )
