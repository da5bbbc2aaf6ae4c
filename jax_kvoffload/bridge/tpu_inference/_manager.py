"""`StoreManager`: tpu-inference's `LRUCacheManager` interface over our `HostStore`.

Their `TPUOffloadConnectorScheduler` (0.32.0) reaches its manager only through five
calls (`tests/tpu_inference/test_interface.py` pins them): `lookup`, `touch`,
`allocate_for_save`, `prepare_load` and `mark_completion`. Each maps onto the store
with `make_offload_key(block_hash, 0)` keys (one chunk is one block of every layer, as
theirs; the engine's block hash covers the whole prefix), so the store's semantics
apply: write-pending chunks are never evicted, loads pin, LRU or ARC decide, events
and stats are the store's. With secondary tiers (`Hub.tier_path`):

- `lookup` counts the leading hashes the host or a tier holds and promotes the tier
  hits into host chunks, waiting for them (their scheduler loads synchronously, so a
  counted hit must be in the host before `prepare_load` pins it);
- `mark_completion(ids, "save")` makes the chunks readable and cascades them to every
  tier (keyed by content: another engine, or this one restarted, is served them).

A save the worker reports failed (`Hub.take_failed`) frees its chunk instead.

Interrupts: these calls run inside vLLM's scheduler step, which does not survive a
KeyboardInterrupt (the engine process ends); unlike `KVOffloader`'s entry points they
do not hold SIGINT (tests/test_layering.py: only the listed entry points may).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jax_kvoffload.bridge.tpu_inference._errors import (
    TPUConnectorStateError,
    UnknownChunkError,
)
from jax_kvoffload.bridge.tpu_inference._hub import Hub
from jax_kvoffload.offloader.internals import prefix_chunks
from jax_kvoffload.store import LookupResult, OffloadKey, make_offload_key

__all__ = ["Chunk", "StoreManager"]

GROUP = 0  # every layer of a block is one chunk: one key space


@dataclass(frozen=True)
class Chunk:
    """What their scheduler reads of a `CPUChunk`: its id (a row of our pool)."""

    chunk_id: int


class StoreManager:
    """Their manager's five calls on our store (see the module docstring)."""

    def __init__(self, hub: Hub) -> None:
        if hub.store is None:
            raise TPUConnectorStateError("the hub has no store: the scheduler role builds it")
        self._hub = hub
        self._store = hub.store
        self._keys: dict[int, OffloadKey] = {}  # chunk id -> key, for mark_completion
        self.num_chunks = hub.num_chunks

    @staticmethod
    def _key(block_hash: bytes) -> OffloadKey:
        return make_offload_key(bytes(block_hash), GROUP)

    def lookup(self, chunk_hashes: Sequence[bytes]) -> int:
        """Leading hashes whose chunks are loadable now (after tier promotions)."""
        keys = [self._key(h) for h in chunk_hashes]
        path = self._hub.tier_path()
        if path is not None:  # KVOffloader's lookup with tiers, waiting (theirs is sync)
            path.process()
            plan = path.plan_lookup(keys, None)  # asks the tiers: bounded calls
            promotions = path.promote_plan(GROUP, plan)
            path.wait(promotions)  # bounded by the tiers' timeouts
            path.process(promotions)
            return path.loadable(plan, recount=True)
        return prefix_chunks([self._store.lookup(k) is LookupResult.HIT for k in keys], None)

    def touch(self, chunk_hashes: Sequence[bytes]) -> None:
        """Marks the present chunks recently used, the first most recent (theirs)."""
        keys = [self._key(h) for h in chunk_hashes]
        if keys:
            self._store.touch(keys)

    def allocate_for_save(
        self, chunk_hashes: Sequence[bytes]
    ) -> tuple[list[Chunk], list[int]] | None:
        """Write-pending chunks for the absent hashes and their positions in the list,
        or None when every hash is present or the store cannot make room (theirs)."""
        path = self._hub.tier_path()
        if path is not None:
            path.process()  # finished cascades unpin their chunks: evictable again
        # Each key once, at its first position: a repeated hash got a second chunk that
        # no key kept (leaked for good).
        position: dict[OffloadKey, int] = {}
        for i, h in enumerate(chunk_hashes):
            position.setdefault(self._key(h), i)
        out = self._store.prepare_store(list(position))
        if out is None or not out.keys_to_store:
            return None
        chunks = []
        for key, chunk in zip(out.keys_to_store, out.chunk_ids, strict=True):
            self._keys[chunk] = key
            chunks.append(Chunk(chunk))
        return chunks, [position[k] for k in out.keys_to_store]

    def prepare_load(self, chunk_hashes: Sequence[bytes]) -> list[Chunk]:
        """Pins the chunks of `chunk_hashes` (all loadable: `lookup` counted them)."""
        keys = [self._key(h) for h in chunk_hashes]
        ids = self._store.prepare_load(keys)
        for key, chunk in zip(keys, ids, strict=True):
            self._keys[chunk] = key
        return [Chunk(c) for c in ids]

    def mark_completion(self, chunk_ids: Sequence[int], operation: str) -> None:
        """The worker finished saving ("save") or loading ("load") these chunks."""
        if operation not in ("save", "load"):
            raise TPUConnectorStateError(f"operation={operation!r}: 'save' or 'load' expected")
        unknown = [c for c in chunk_ids if c not in self._keys]
        if unknown:  # theirs raises ValueError before changing anything, as this does
            raise UnknownChunkError(operation, list(chunk_ids), unknown)
        known = list(chunk_ids)
        if operation == "load":
            self._store.complete_load([self._keys[c] for c in known])
            return
        failed = self._hub.take_failed(known)
        if failed:
            self._store.complete_store([self._keys[c] for c in failed], success=False)
        done = [self._keys[c] for c in known if c not in failed]
        if not done:
            return
        self._store.complete_store(done, success=True)
        path = self._hub.tier_path()
        if path is not None:
            path.cascade(GROUP, done)
