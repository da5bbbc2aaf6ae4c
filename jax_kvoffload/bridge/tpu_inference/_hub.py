"""What the scheduler and worker roles of one engine share in its process.

tpu-inference runs both roles of a single-host engine in one process (its platform
forces vLLM's `UniProcExecutor` unless `TPU_MULTIHOST_BACKEND` is set), and vLLM hands
both the same `VllmConfig` object. The `Hub` of that object holds:

- the `HostStore` (built by the scheduler role: their `TPUOffloadConnectorScheduler`
  drives it through `StoreManager`);
- the host pool and the `TransferEngine` (built by the worker role at
  `register_runner`, when the caches' shapes are known): a chunk id of the store is a
  row of the pool in every layer-shape group;
- the secondary tiers and the `TierPath` between store, pool and tiers (driven only
  from the scheduler role's calls);
- the failure channel their scheduler lacks: chunk ids whose save failed, set by the
  worker before it reports the chunk, read by `StoreManager.mark_completion`.

The roles never call into each other; the pool's rows are handed over by the store's
protocol (a row is written only while write-pending, read only while pinned).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from jax_kvoffload.config import HostTierConfig
from jax_kvoffload.hostmem import HostPool
from jax_kvoffload.offloader.internals import TierPath
from jax_kvoffload.store import HostStore
from jax_kvoffload.tiers import SecondaryTier
from jax_kvoffload.transfer import TransferEngine

__all__ = ["Hub", "hub_for"]


@dataclass
class Hub:
    """One engine's shared parts (see the module docstring)."""

    host: HostTierConfig
    num_chunks: int
    store: HostStore | None = None
    pool: HostPool | None = None
    engine: TransferEngine | None = None
    tiers: tuple[SecondaryTier, ...] = ()
    groups: int = 0  # layer-shape groups of the pool (one row per chunk in each)
    _tier_path: TierPath | None = None
    _failed: set[int] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def attach_worker(
        self, pool: HostPool, engine: TransferEngine, tiers: tuple[SecondaryTier, ...], groups: int
    ) -> None:
        self.pool, self.engine, self.tiers, self.groups = pool, engine, tiers, groups

    def tier_path(self) -> TierPath | None:
        """The tier path, once store, pool and tiers all exist (None without tiers)."""
        ready = self.tiers and self.store is not None and self.pool is not None
        if self._tier_path is None and ready:
            self._tier_path = TierPath(self.tiers, self.store, self.pool)  # type: ignore[arg-type]
        return self._tier_path

    def fail_saves(self, chunk_ids: list[int]) -> None:
        """Worker side: these chunks' saves failed (reported to the scheduler as done,
        so that its staging and request bookkeeping moves on)."""
        with self._lock:
            self._failed.update(chunk_ids)

    def take_failed(self, chunk_ids: list[int]) -> set[int]:
        """Scheduler side: which of `chunk_ids` failed (forgotten once taken)."""
        with self._lock:
            failed = self._failed.intersection(chunk_ids)
            self._failed -= failed
        return failed

    def close(self) -> None:
        """Drains the tier path and closes the engine and the tiers (process exit)."""
        path = self._tier_path
        if path is not None:
            path.close(own=True)
        else:
            for tier in self.tiers:
                tier.close()
        if self.engine is not None:
            self.engine.close()


_HUBS: dict[int, Hub] = {}
_HUBS_LOCK = threading.Lock()


def hub_for(vllm_config: object, make: Callable[[], Hub]) -> Hub:
    """The hub of this `VllmConfig` object, made by `make()` for its first role."""
    key = id(vllm_config)
    with _HUBS_LOCK:
        hub = _HUBS.get(key)
        if hub is None:
            hub = _HUBS[key] = make()
            # Dropped with the config (its id may be reused after that); a config that
            # is not weak-referenceable keeps its hub for the process.
            with contextlib.suppress(TypeError):
                weakref.finalize(vllm_config, _drop, key)
        return hub


def _drop(key: int) -> None:
    with _HUBS_LOCK:
        hub = _HUBS.pop(key, None)
    if hub is not None:
        hub.close()
