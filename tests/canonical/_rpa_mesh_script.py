"""Run in a subprocess with 8 simulated CPU devices (see test_rpa_canonical.py).

Canonical pages of ragged-paged-attention v3 caches across meshes: for every dtype and
KV-head count, the global cache packed for S = 1, 2, 4, 8 KV-head shards (each shard
padding its slots where 2H/S is not a multiple of the packing; every padding byte noise)
is stored through a `TransferEngine`; the host rows must be the same for every S and
equal a numpy model of the canonical page (the real slots, head_dim lanes included).
Then rows written under one mesh load into a noise-filled cache on another: the real
slots of the loaded blocks carry the stored bytes, every other byte (padding slots of
the loaded blocks, the other blocks) keeps the target's. Last, one `KVOffloader` stores
on 2 shards, moves to 4 (`set_caches`, a cache of another shape) and to 1, and loads the
prefix bit for bit each time. Prints "ok <n>"; raises otherwise.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from jax_kvoffload import KVOffloader
from jax_kvoffload.hostmem import HostChunkPool
from jax_kvoffload.transfer import GroupCaches, GroupTransfer, TransferEngine
from tests.canonical.rpa_common import (
    HEAD_DIM,
    NB,
    as_bits,
    hashes,
    rpa_bits,
    rpa_config,
)

BLOCKS, CHUNKS = (5, 0, 3, 11), (1, 0)
TARGET = (2, 7, 9, 10)
JOB = [GroupTransfer(0, BLOCKS, CHUNKS)]
LOAD = [GroupTransfer(0, TARGET, CHUNKS)]
CASES = [("bf16", 8), ("fp16", 4), ("fp32", 2), ("fp8_e4m3", 4), ("fp8_e5m2", 8), ("int8", 4)]
CASES += [("fp8_e4m3", 2)]  # on 2 shards: one real head, 2 slots in 4


def sharding(s: int, two_axes: bool) -> NamedSharding:
    if two_axes:  # tpu-inference's P("data", None, "model") with one data device
        mesh = Mesh(np.array(jax.devices()[:s]).reshape(1, s), ("data", "model"))
        return NamedSharding(mesh, P("data", None, "model"))
    mesh = Mesh(np.array(jax.devices()[:s]), ("model",))
    return NamedSharding(mesh, P(None, None, "model"))


def put(arrays, s: int, two_axes: bool = False):
    return [jax.device_put(a, sharding(s, two_axes)) for a in arrays]


def canonical_model(cache: np.ndarray, heads: int, s: int) -> np.ndarray:
    """[nb, bs, 2H, D] bits: each shard's real slots in order (numpy, on bits)."""
    real, padded = pk.rpa_slots_per_shard(heads, cache.dtype, s)
    nb, bs, _, _, d = cache.shape
    return as_bits(cache).reshape(nb, bs, s, padded, d)[..., :real, :].reshape(nb, bs, -1, d)


def move(caches: GroupCaches, pool, direction: str):
    with TransferEngine({0: caches}, pool, backend="xla") as engine:
        getattr(engine, f"submit_{direction}")(1, JOB if direction == "store" else LOAD)
        (result,) = engine.wait([1])
        if not result.success:
            raise RuntimeError(result.error)
        return engine.arrays(0)


def shard_counts(heads: int) -> list[int]:
    return [s for s in (1, 2, 4, 8) if heads % s == 0]


def check_meshes(dtype: str, heads: int) -> int:
    pools, want = {}, None
    for s in shard_counts(heads):
        src = rpa_bits(dtype, heads, s, seed=0, noise_seed=s)  # same K/V, other noise
        gc = GroupCaches(put(src, s, two_axes=s == 4), "rpa", canonical_kv_heads=heads)
        pool = HostChunkPool(2, {0: gc.block_bytes}, 2)
        move(gc, pool, "store")
        order = [b for c in range(2) for b in BLOCKS[2 * CHUNKS.index(c) :][:2]]  # row order
        model = np.stack([canonical_model(c, heads, s)[order] for c in src], axis=1)
        model = model.reshape(2, -1).view(np.uint8)
        rows = pool.rows(0)
        assert np.array_equal(rows.reshape(2, -1), model), f"{dtype} H={heads} S={s}: rows"
        # The same rows from every mesh (head_dim's padding lanes hold each source's
        # noise, moved as bytes: compare the real lanes).
        lanes = rows.view(as_bits(src[0]).dtype).reshape(-1, src[0].shape[4])[:, :HEAD_DIM]
        assert want is None or np.array_equal(lanes, want), f"{dtype} H={heads} S={s}: mesh"
        want, pools[s] = lanes, pool
    checked = 0
    counts = shard_counts(heads)
    for src_s in counts:
        for dst_s in counts:
            if src_s == dst_s and src_s not in (1, counts[-1]):
                continue
            stored = rpa_bits(dtype, heads, src_s, seed=0, noise_seed=src_s)
            target = rpa_bits(dtype, heads, dst_s, seed=100 + dst_s)  # noise everywhere
            gc = GroupCaches(put(target, dst_s), "rpa", canonical_kv_heads=heads)
            before = gc.arrays[0].sharding
            out = move(gc, pools[src_s], "load")
            assert out[0].sharding == before, (out[0].sharding, before)
            real, padded = pk.rpa_slots_per_shard(heads, target[0].dtype, dst_s)
            for got, t, st in zip(out, target, stored, strict=True):
                expect = as_bits(t).copy().reshape(NB, *t.shape[1:2], dst_s, padded, -1)
                canon = canonical_model(st, heads, src_s)[list(BLOCKS)]
                canon = canon.reshape(len(BLOCKS), canon.shape[1], dst_s, real, -1)
                expect[list(TARGET), :, :, :real] = canon
                g = as_bits(got).reshape(expect.shape)
                where = f"{dtype} H={heads} {src_s}->{dst_s}"
                assert np.array_equal(g, expect), f"{where}: {int((g != expect).sum())} bytes"
            checked += 1
    return checked


def check_offloader_remesh(dtype: str, heads: int) -> None:
    cfg = rpa_config(dtype, heads, canonical=True)
    src = rpa_bits(dtype, heads, 2, seed=1)
    h = hashes("remesh", 4)
    with KVOffloader(cfg, put(src, 2), backend="xla", total_kv_heads=heads) as off:
        assert off.wait([off.store(h, [1, 2, 3, 4])])[0].success
        for s, two in ((4, True), (1, False), (2, False)):
            target = rpa_bits(dtype, heads, s, seed=50 + s)
            off.set_caches(put(target, s, two))
            assert off.lookup(h) == 4
            assert off.wait([off.load(h, [8, 9, 10, 11])])[0].success
            out = off.caches()
            for got, t, st in zip(out, target, src, strict=True):
                want = canonical_model(st, heads, 2)[1:5]
                g = canonical_model(np.asarray(got), heads, s)
                assert np.array_equal(g[8:12], want), f"offloader {dtype} 2->{s}"
                keep = [i for i in range(NB) if i not in (8, 9, 10, 11)]
                assert np.array_equal(as_bits(got)[keep], as_bits(t)[keep]), f"kept 2->{s}"
                real, padded = pk.rpa_slots_per_shard(heads, t.dtype, s)
                pad = as_bits(got).reshape(NB, t.shape[1], s, padded, -1)[8:12, :, :, real:]
                ref = as_bits(t).reshape(NB, t.shape[1], s, padded, -1)[8:12, :, :, real:]
                assert np.array_equal(pad, ref), f"padding of loaded blocks 2->{s}"


def check_sharded_refusals() -> int:
    """A sharded RPA cache whose rows do not hold the model's heads on its mesh is
    refused, by the engine and by the offloader, with a typed error naming the shards
    (fp8, 4 heads: packed for 4 shards each padded to one row, placed on 2 devices,
    where 2 rows a shard would hold 3-4 heads each: 6 or 8 in all, never 4)."""
    from jax_kvoffload.offloader import CacheConfigMismatchError
    from jax_kvoffload.transfer import TransferError

    four = rpa_bits("fp8_e4m3", 4, 4, seed=7)
    refused = 0
    # 4 heads: not these rows on 2 shards; 3: a head count that does not split over 2
    for heads, words in ((4, "sharded over 2 KV-head shard(s)"), (3, "over shards=2")):
        try:
            GroupCaches(put(four, 2), "rpa", canonical_kv_heads=heads)
        except TransferError as e:
            assert "arrays[0]" in str(e) and words in str(e), e
            refused += 1
    # the same rows on the mesh they were packed for are accepted
    GroupCaches(put(four, 4, two_axes=True), "rpa", canonical_kv_heads=4)
    said = {  # the canonical-page check; the bytes-per-block check, with the right shape
        True: ["sharded over 2 KV-head shard(s) should have (kv_rows, packing) = (2, 4)"],
        False: ["(float8_e4m3fn, 2 KV-head shard(s)) hold 6 or 8 KV heads", "(12, 4, 2, 4, 128)"],
    }
    for canonical, words in said.items():
        cfg = rpa_config("fp8_e4m3", 4, canonical=canonical)
        try:
            KVOffloader(cfg, put(four, 2), backend="xla", total_kv_heads=4).close()
        except CacheConfigMismatchError as e:
            assert all(w in str(e) for w in words), e
            refused += 1
        KVOffloader(cfg, put(four, 4), backend="xla", total_kv_heads=4).close()
    assert refused == 4, refused
    return refused


def main():
    if sys.argv[1:] == ["refusals"]:
        print("ok", check_sharded_refusals())
        return
    checked = check_sharded_refusals()
    for dtype, heads in CASES:
        checked += check_meshes(dtype, heads)
    check_offloader_remesh("fp8_e4m3", 4)
    check_offloader_remesh("bf16", 4)
    print("ok", checked)


if __name__ == "__main__":
    main()
