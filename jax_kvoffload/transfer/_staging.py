"""Staging helpers of both worker engines: host copies of staging, bucket sizes, reused
buffers (the JAX engine's _copies.py and the vLLM bridge's torch worker)."""

from __future__ import annotations

import threading

import jax
import numpy as np


def host_sharding(staging: jax.Array) -> jax.sharding.Sharding | None:
    """The staging array's own sharding in pinned host memory (when the platform has it).

    Derived from the staging array, not the caches: a cache's partition spec names the
    cache's axes, which are not the staging's `[n, arrays, *page]` axes.
    """
    kinds = {m.kind for m in next(iter(staging.devices())).addressable_memories()}
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            return staging.sharding.with_memory_kind(kind)
    return None


def to_host(stagings: list[jax.Array], on_cpu: list[bool]) -> list[jax.Array]:
    """A store's stagings on their way to host memory: one `device_put` of them all into
    pinned host memory where the platform has it (asynchronous; read them with
    `np.asarray`, or wait with `jax.block_until_ready`). On CPU (`on_cpu`) a device
    array already is host memory: numpy reads it in place, and a `device_put` would only
    add a copy; so does a platform without host memory kinds."""
    shardings = [None if cpu else host_sharding(s) for s, cpu in zip(stagings, on_cpu, strict=True)]
    moved = [i for i, sharding in enumerate(shardings) if sharding is not None]
    out = list(stagings)
    if moved:
        placed = jax.device_put([stagings[i] for i in moved], [shardings[i] for i in moved])
        for i, host in zip(moved, placed, strict=True):
            out[i] = host
    return out


def bucket_for(block_bytes: int, max_bucket: int, max_staging_bytes: int) -> int:
    """The largest power of two <= max_bucket whose staging fits max_staging_bytes."""
    bucket = max_bucket
    while bucket > 1 and bucket * block_bytes > max_staging_bytes:
        bucket //= 2
    return bucket


def replicated(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
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
