"""Staging helpers of both worker engines: host copies of staging, bucket sizes, reused
buffers (the JAX engine's _copies.py and the vLLM bridge's torch worker)."""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np


def host_sharding(staging: jax.Array) -> Any:
    """The staging array's own sharding in pinned host memory (when the platform has it).

    Derived from the staging array, not the caches: a cache's partition spec names the
    cache's axes, which are not the staging's `[n, arrays, *page]` axes.
    """
    kinds = {m.kind for m in next(iter(staging.devices())).addressable_memories()}
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            return staging.sharding.with_memory_kind(kind)
    return None


def to_host(staging: jax.Array, on_cpu: bool) -> Any:
    """A store's staging on its way to host memory: `device_put` into pinned host memory
    where the platform has it (asynchronous; read it with `np.asarray`). On CPU
    (`on_cpu`) the device array already is host memory: numpy reads it in place, and a
    `device_put` would only add a copy; so does a platform without host memory kinds."""
    sharding = None if on_cpu else host_sharding(staging)
    return staging if sharding is None else jax.device_put(staging, sharding)


def bucket_for(block_bytes: int, max_bucket: int, max_staging_bytes: int) -> int:
    """The largest power of two <= max_bucket whose staging fits max_staging_bytes."""
    bucket = max_bucket
    while bucket > 1 and bucket * block_bytes > max_staging_bytes:
        bucket //= 2
    return bucket


def replicated(sharding: Any) -> Any:
    """A sharding that places a whole staging array on every device of `sharding`."""
    mesh = getattr(sharding, "mesh", None)
    if mesh is None:
        return sharding  # single device
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


class HostBuffers:
    """Reused host staging buffers for loads, by shape, up to `limit` bytes kept free.

    Fresh multi-MiB allocations spend most of their time in page faults (measured on
    CPU: system time dominated the load path). A load holds one buffer per distinct shard
    of each bucket until its scatter has read them, so the bound is in bytes (enough for
    two jobs' staging), not in buffers per shape. A buffer that is never given back (a
    failed or interrupted job) is simply left to the garbage collector.
    """

    def __init__(self, limit: int) -> None:
        self._free: dict[tuple[int, int], list[np.ndarray]] = {}
        self._free_bytes = 0
        self._limit = limit
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, int]) -> np.ndarray:
        with self._lock:
            free = self._free.get(shape)
            if free:
                buffer = free.pop()
                self._free_bytes -= buffer.nbytes
                return buffer
        # 64-byte aligned: XLA:CPU then adopts the buffer in device_put instead of
        # copying it (an unaligned numpy buffer is copied: measured 1.5-2 GB/s).
        raw = np.empty(shape[0] * shape[1] + 64, dtype=np.uint8)
        offset = -raw.ctypes.data % 64
        return raw[offset : offset + shape[0] * shape[1]].reshape(shape)

    def give(self, buffer: np.ndarray) -> None:
        with self._lock:
            if self._free_bytes + buffer.nbytes <= self._limit:
                self._free.setdefault(buffer.shape, []).append(buffer)
                self._free_bytes += buffer.nbytes
