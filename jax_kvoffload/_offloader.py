"""`KVOffloader`: one object a JAX serving stack drives to offload and reuse KV blocks.

It joins the scheduler side (a `HostStore`: which chunks exist, pins, eviction) and the
worker side (a `TransferEngine`: the bytes) for an engine that runs both in one process.

Call protocol (single-threaded: call every method from the engine's thread):

    with KVOffloader(config, caches) as off:
        job = off.store(block_hashes, block_ids)        # after a prefill: async copy out
        ...
        n = off.lookup(block_hashes)                    # leading blocks available on host
        job = off.load(block_hashes[:n], new_block_ids) # async copy in
        off.wait([job]); caches = off.caches()          # arrays now hold the prefix

A chunk is `blocks_per_chunk` consecutive blocks; its key is the engine's hash of the
chunk's last block plus the group index (the hash already covers the whole prefix).
Only whole chunks are stored or loaded.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from jax_kvoffload.config import OffloadingConfig
from jax_kvoffload.store import HostStore, LookupResult, make_offload_key
from jax_kvoffload.transfer import (
    Direction,
    GroupCaches,
    GroupTransfer,
    HostChunkPool,
    TransferEngine,
    TransferError,
    TransferResult,
    check_global_caches,
)

logger = logging.getLogger(__name__)


class OffloaderError(ValueError):
    """Bad arguments to a `KVOffloader` call (the message says which and why)."""


@dataclass
class _Job:
    direction: Direction
    group: int
    keys: list[bytes]
    generation: int


def _check_canonical(caches: Mapping[int, GroupCaches], total_kv_heads: int | None) -> None:
    if total_kv_heads is None:
        raise OffloaderError(
            "canonical_layout is set: pass total_kv_heads= (the model's KV heads) so the "
            "offloader can check that the caches are global arrays, whose pages are the "
            "canonical pages; or drop 'canonical_layout' from the extra config"
        )
    for g, gc in caches.items():
        try:
            check_global_caches(gc, total_kv_heads)
        except TransferError as e:
            raise OffloaderError(f"group {g}: {e}") from e


class KVOffloader:
    """Offloads KV chunks of a JAX engine to host memory and loads them back.

    Args:
      config: the `OffloadingConfig` (`build_offloading_config`).
      caches: group id -> `GroupCaches`, or one `GroupCaches` for group 0. The offloader
        owns the arrays afterwards: read them back with `caches(group)`.
      cpu_bytes_to_use: host budget; defaults to `config.extra_config["cpu_bytes_to_use"]`.
      eviction_policy: "lru" or "arc"; defaults to the extra config's, else "lru".
      backend, interpret: kernel backend for `pallas_kernels` ("auto" by platform).
      max_bucket: largest block count per kernel call.
      total_kv_heads: the model's KV heads; required with `config.canonical_layout`, where
        every array must be the global view (all heads, sharded over any mesh) so that its
        pages are the canonical, topology-free pages (docs/canonical.md).
    """

    def __init__(
        self,
        config: OffloadingConfig,
        caches: Mapping[int, GroupCaches] | GroupCaches,
        *,
        cpu_bytes_to_use: int | None = None,
        eviction_policy: str | None = None,
        backend: str = "auto",
        interpret: Any = False,
        max_bucket: int = 256,
        total_kv_heads: int | None = None,
    ) -> None:
        if isinstance(caches, GroupCaches):
            caches = {config.groups[0].group_id: caches}
        if config.canonical_layout:
            _check_canonical(caches, total_kv_heads)
        self._groups = {g.group_id: g for g in config.groups}
        unknown = sorted(set(caches) - set(self._groups))
        missing = sorted(set(self._groups) - set(caches))
        if unknown or missing:
            raise OffloaderError(
                f"caches must cover exactly the offloaded groups {sorted(self._groups)}; "
                f"unknown {unknown}, missing {missing}"
            )
        self._bpc = config.cache.blocks_per_chunk
        if self._bpc < 1:
            raise OffloaderError(
                f"blocks_per_chunk={self._bpc}: 'block_size': 0 in the extra config gives "
                "chunks of no blocks; set 'blocks_per_chunk' >= 1"
            )
        extra = config.extra_config
        budget = cpu_bytes_to_use if cpu_bytes_to_use is not None else extra.get("cpu_bytes_to_use")
        if budget is None:
            raise OffloaderError(
                "cpu_bytes_to_use is required: pass it or set it in kv_connector_extra_config"
            )
        bytes_per_block = {g: gc.block_bytes for g, gc in caches.items()}
        # One chunk id addresses a row in every group, as vLLM's CPU tier sizes chunks
        # for all offloaded groups together.
        # Global (canonical) arrays hold every rank's bytes in this one process: one copy.
        canonical = config.canonical_layout
        self._store = HostStore.from_cpu_budget(
            int(budget),
            worker_kv_bytes_per_block=sum(bytes_per_block.values()),
            blocks_per_chunk=self._bpc,
            world_size=1 if canonical else config.parallel.world_size,
            replicated_layout=False if canonical else config.replicated_layout,
            eviction_policy=eviction_policy or extra.get("eviction_policy", "lru"),
            enable_events=config.enable_kv_cache_events,
        )
        self._pool = HostChunkPool(self._store.num_chunks, bytes_per_block, self._bpc)
        self._engine = TransferEngine(
            caches, self._pool, backend=backend, interpret=interpret, max_bucket=max_bucket
        )
        self._jobs: dict[int, _Job] = {}
        self._ids = itertools.count(1)
        self.config = config

    # -- queries ------------------------------------------------------------------

    @property
    def store_stats(self) -> Any:
        return self._store.get_stats()

    @property
    def num_chunks(self) -> int:
        return self._store.num_chunks

    @property
    def host_bytes(self) -> int:
        return self._pool.nbytes

    def caches(self, group: int | None = None) -> list[jax.Array]:
        """The group's current device arrays (replaced by each completed load)."""
        return self._engine.arrays(self._group(group))

    def set_caches(self, arrays: Sequence[jax.Array], group: int | None = None) -> None:
        """Hands back the group's arrays after the engine wrote its own K/V into them.

        Start from `caches(group)` read after the last completed load (a load replaces
        the arrays); shapes and dtypes must stay the same (`TransferError` otherwise).
        The sharding may change: an engine that moves to another mesh passes its new
        global arrays, and chunks stored before load into them (with canonical pages,
        whatever the TP size; docs/canonical.md).
        """
        self._engine.set_arrays(self._group(group), arrays)

    def take_events(self) -> list[Any]:
        return self._store.take_events()

    def lookup(self, block_hashes: Sequence[bytes], *, group: int | None = None) -> int:
        """How many leading blocks can be loaded now (a multiple of blocks_per_chunk).

        Full-attention groups need every chunk of the prefix; a sliding-window group of
        W chunks needs only the last W before the prefix end, so the longest prefix
        whose trailing W chunks are all stored counts.
        """
        g = self._group(group)
        hits = [
            self._store.lookup(make_offload_key(h, g)) is LookupResult.HIT
            for h in self._chunk_hashes(block_hashes)
        ]
        window = self._groups[g].sliding_window_size_in_chunks
        if window is None:
            n = next((i for i, hit in enumerate(hits) if not hit), len(hits))
        else:
            n = 0
            for end in range(len(hits), 0, -1):
                if all(hits[max(0, end - window) : end]):
                    n = end
                    break
        return n * self._bpc

    # -- transfers ------------------------------------------------------------------

    def store(
        self, block_hashes: Sequence[bytes], block_ids: Sequence[int], *, group: int | None = None
    ) -> int | None:
        """Starts offloading the whole chunks of a sequence; returns a job id.

        Chunks already stored are skipped; for a sliding-window group only the last W
        chunks are offered. Returns None when there is nothing to store or the host
        store cannot make room (the offer is dropped, as vLLM does).
        """
        g = self._group(group)
        hashes, ids = self._chunks(block_hashes, block_ids)
        keys = [make_offload_key(h, g) for h in hashes]
        window = self._groups[g].sliding_window_size_in_chunks
        offered = keys if window is None else keys[max(0, len(keys) - window) :]
        if not offered:
            return None
        out = self._store.prepare_store(offered)
        if out is None or not out.keys_to_store:
            return None
        position = {k: i for i, k in enumerate(keys)}
        blocks: list[int] = []
        for key in out.keys_to_store:
            blocks += ids[position[key]]
        job = next(self._ids)
        transfer = GroupTransfer(g, tuple(blocks), tuple(out.chunk_ids))
        self._submit(job, Direction.STORE, g, list(out.keys_to_store), transfer)
        return job

    def load(
        self, block_hashes: Sequence[bytes], block_ids: Sequence[int], *, group: int | None = None
    ) -> int | None:
        """Starts loading the chunks of `block_hashes` into `block_ids`; returns a job id.

        Every chunk must be a `lookup` hit (its store finished). The chunks stay pinned,
        so they cannot be evicted, until the job completes.
        """
        g = self._group(group)
        hashes, ids = self._chunks(block_hashes, block_ids)
        if not hashes:
            return None
        keys = [make_offload_key(h, g) for h in hashes]
        chunk_ids = self._store.prepare_load(keys)
        job = next(self._ids)
        blocks = tuple(b for chunk in ids for b in chunk)
        self._submit(job, Direction.LOAD, g, keys, GroupTransfer(g, blocks, tuple(chunk_ids)))
        return job

    def poll(self) -> list[TransferResult]:
        """Results of jobs that ended since the last call; never blocks."""
        return [self._finish(r) for r in self._engine.get_finished()]

    def wait(self, job_ids: Iterable[int] | None = None) -> list[TransferResult]:
        """Blocks until the jobs (default: all in flight) end; returns their results."""
        ids = list(self._jobs) if job_ids is None else [j for j in job_ids if j is not None]
        return [self._finish(r) for r in self._engine.wait(ids)]

    def reset_cache(self) -> None:
        """Forgets every stored chunk; jobs in flight finish but are not recorded."""
        self._store.reset_cache()

    def close(self) -> None:
        """Waits for jobs in flight, records them, and stops the transfer threads."""
        if self._jobs:
            self.wait()
        self._engine.close()

    def __enter__(self) -> KVOffloader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------

    def _group(self, group: int | None) -> int:
        if group is None:
            if len(self._groups) != 1:
                raise OffloaderError(f"pass group=; this config has groups {sorted(self._groups)}")
            return next(iter(self._groups))
        if group not in self._groups:
            raise OffloaderError(
                f"group {group} is not offloaded; groups are {sorted(self._groups)}"
            )
        return group

    def _chunk_hashes(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        # A chunk's key is its last block's hash: that hash covers the whole prefix.
        n = len(block_hashes) // self._bpc
        return [self._hash(block_hashes[(c + 1) * self._bpc - 1]) for c in range(n)]

    def _chunks(
        self, block_hashes: Sequence[bytes], block_ids: Sequence[int]
    ) -> tuple[list[bytes], list[list[int]]]:
        if len(block_hashes) != len(block_ids):
            raise OffloaderError(
                f"block_hashes has {len(block_hashes)} entries but block_ids has "
                f"{len(block_ids)}; pass one hash per block"
            )
        hashes = self._chunk_hashes(block_hashes)
        bpc = self._bpc
        ids = [[int(b) for b in block_ids[c * bpc : (c + 1) * bpc]] for c in range(len(hashes))]
        return hashes, ids

    @staticmethod
    def _hash(value: Any) -> bytes:
        if not isinstance(value, (bytes, bytearray)):
            raise TypeError(f"block hashes must be bytes, got {type(value).__name__}")
        return bytes(value)

    def _submit(
        self, job: int, direction: Direction, group: int, keys: list[bytes], t: GroupTransfer
    ) -> None:
        record = _Job(direction, group, keys, self._store.cache_generation)
        try:
            if direction is Direction.STORE:
                self._engine.submit_store(job, [t])
            else:
                self._engine.submit_load(job, [t])
        except Exception:
            # Nothing was queued: give the chunks back before reporting the misuse.
            if direction is Direction.STORE:
                self._store.complete_store(keys, success=False)
            else:
                self._store.complete_load(keys)
            raise
        self._jobs[job] = record

    def _finish(self, result: TransferResult) -> TransferResult:
        job = self._jobs.pop(result.job_id)
        if job.generation != self._store.cache_generation:
            return result  # the cache was reset meanwhile: these keys are gone
        if job.direction is Direction.STORE:
            self._store.complete_store(job.keys, success=result.success)
        else:
            self._store.complete_load(job.keys)
        return result
