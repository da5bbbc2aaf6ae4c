"""Host copies of staging arrays split over several devices, one shard at a time.

A staging array gathered from mesh-sharded caches is split along its page axes (each
device holds its KV heads of every block). Assembling it into one numpy array and then
copying that into the pool rows would move every byte twice on the host; these helpers
move each distinct shard once, straight between its device buffer and its place in the
rows (`HostChunkPool.move_shards`). Replicas (a mesh axis the caches do
not use) are written once and read once per distinct shard.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

Shard = tuple[tuple[slice, ...], np.ndarray]


def _whole_blocks(index: tuple[slice, ...]) -> bool:
    return index[0] == slice(None)


def distinct_shards(host: jax.Array) -> list[Shard] | None:
    """`(index, data)` of each distinct shard of `host` (one replica each), or None when
    numpy can read it whole (one device, fully replicated, or split along blocks)."""
    sharding = host.sharding
    if len(sharding.device_set) == 1 or sharding.is_fully_replicated:
        return None
    shards = [s for s in host.addressable_shards if s.replica_id == 0]
    if not sharding.is_fully_addressable or not all(_whole_blocks(s.index) for s in shards):
        return None
    return [(s.index, np.asarray(s.data)) for s in shards]


def fetch_sharded(
    read_shards: Callable[[list[Shard]], None],
    take: Callable[[tuple[int, int]], np.ndarray],
    shape: tuple[int, ...],
    dtype: np.dtype,
    sharding: jax.sharding.Sharding,
) -> tuple[jax.Array, list[np.ndarray]] | None:
    """Reads each distinct shard of a `shape` staging array from the pool into its own
    host buffer (`take((n, bytes))`), puts it on its devices and assembles the global
    array. Returns it and the buffers (to give back once the array is consumed), or None
    when the sharding does not suit (not addressable here, or split along blocks)."""
    if not sharding.is_fully_addressable:
        return None
    index_map = sharding.devices_indices_map(shape)
    if not all(_whole_blocks(ix) for ix in index_map.values()):
        return None
    itemsize = np.dtype(dtype).itemsize
    keys = {
        device: tuple((s.start, s.stop, s.step) for s in ix) for device, ix in index_map.items()
    }
    by_key: dict[tuple[tuple[int | None, int | None, int | None], ...], np.ndarray] = {}
    buffers, shards = [], []
    for device, ix in index_map.items():
        if keys[device] in by_key:
            continue  # a replica: read once
        local = tuple(len(range(*s.indices(d))) for s, d in zip(ix, shape, strict=True))
        raw = take((shape[0], int(np.prod(local[1:])) * itemsize))
        buffers.append(raw)
        by_key[keys[device]] = raw.view(dtype).reshape(local)
        shards.append((ix, by_key[keys[device]]))
    read_shards(shards)
    # One device_put for every device: one dispatch, not one per device.
    devices = list(index_map)
    arrays = jax.device_put([by_key[keys[d]] for d in devices], devices)
    staged = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
    return jax.block_until_ready(staged), buffers
