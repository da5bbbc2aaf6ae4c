"""KVOffloader end to end on CPU: narrated scenarios, faults, and a randomized model check."""

from __future__ import annotations

import hashlib

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pallas_kernels as pk
from jax_kvoffload import GroupCaches, KVOffloader, OffloaderError
from jax_kvoffload.config import (
    CacheConfig,
    EngineConfig,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SlidingWindowSpec,
    build_offloading_config,
)
from jax_kvoffload.store import KeyNotReadyError

NB, BS, H, D = 16, 4, 2, 8
BLOCK_BYTES = 2 * BS * H * D * 2  # two uint16 layers


def config(bpc=2, budget=1 << 20, window=None, extra=None, heads=H, tp=1):
    # Each layer's array holds K|V packed along its last axis: head_size is half of D.
    common = dict(block_size=BS, num_kv_heads=heads // tp, head_size=D // 2, dtype="uint16")
    spec = (
        FullAttentionSpec(**common)
        if window is None
        else SlidingWindowSpec(**common, sliding_window=window)
    )
    engine = EngineConfig(
        model_config=ModelConfig(model="m", dtype="float16", total_num_kv_heads=heads),
        cache_config=CacheConfig(block_size=BS),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=KVTransferConfig(
            kv_connector_extra_config={
                "cpu_bytes_to_use": budget,
                "blocks_per_chunk": bpc,
                **(extra or {}),
            },
            engine_id="e",
        ),
    )
    kv = KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=("l0", "l1"), kv_cache_spec=spec),),
    )
    return build_offloading_config(engine, kv)


def arrays(seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.integers(0, 2**16, (NB, BS, H, D), dtype=np.uint16)) for _ in range(2)]


def offloader(cfg=None, seed=0, **kw):
    data = arrays(seed)
    off = KVOffloader(cfg or config(), GroupCaches(data, pk.KVLayout.nhd()), backend="xla", **kw)
    return off, [np.asarray(a).copy() for a in data]


def hashes(prefix: str, n: int) -> list[bytes]:
    out, parent = [], b""
    for i in range(n):
        parent = hashlib.sha256(parent + f"{prefix}:{i}".encode()).digest()
        out.append(parent)
    return out


def test_store_lookup_load_round_trip():
    off, before = offloader()
    h = hashes("a", 6)
    with off:
        job = off.store(h, [1, 2, 3, 4, 5, 6])
        # Not readable until the store completes.
        assert off.lookup(h) in (0, 6)
        assert off.wait([job])[0].success
        assert off.lookup(h) == 6
        assert off.lookup(h[:5]) == 4  # whole chunks only
        assert off.lookup(hashes("b", 6)) == 0
        load = off.load(h, [10, 11, 12, 13, 14, 15])
        assert off.wait([load])[0].success
        after = [np.asarray(a) for a in off.caches()]
    for layer in range(2):
        np.testing.assert_array_equal(after[layer][10:16], before[layer][1:7])
        np.testing.assert_array_equal(after[layer][:10], before[layer][:10])


def test_already_stored_chunks_are_not_copied_again():
    off, _ = offloader()
    h = hashes("a", 4)
    with off:
        off.wait([off.store(h, [1, 2, 3, 4])])
        assert off.store(h, [1, 2, 3, 4]) is None
        job = off.store(hashes("a", 6), [1, 2, 3, 4, 5, 6])  # only the new chunk moves
        (result,) = off.wait([job])
    assert result.size_bytes == 2 * BLOCK_BYTES


def test_a_full_store_drops_the_offer_and_evicts_the_oldest():
    # 4 KiB host pages per chunk: budget for exactly two chunks.
    off, _ = offloader(config(budget=2 * 4096))
    with off:
        assert off.num_chunks == 2
        off.wait([off.store(hashes("a", 4), [0, 1, 2, 3])])
        # Order is now a:0, a:1. Storing b's two chunks evicts both.
        off.wait([off.store(hashes("b", 4), [4, 5, 6, 7])])
        assert off.lookup(hashes("a", 4)) == 0
        assert off.lookup(hashes("b", 4)) == 4
        # A load pins b's chunks: a new offer cannot evict them, so it is dropped.
        load = off.load(hashes("b", 4), [8, 9, 10, 11])
        assert off.store(hashes("c", 2), [12, 13]) is None
        off.wait([load])
        assert off.store(hashes("c", 2), [12, 13]) is not None
        off.wait()


def test_loading_a_chunk_whose_store_is_pending_is_refused():
    off, _ = offloader()
    h = hashes("a", 2)
    with off:
        off.store(h, [1, 2])
        try:
            with pytest.raises(KeyNotReadyError):
                off.load(h, [5, 6])
        finally:
            off.wait()
        assert off.lookup(h) == 2


def test_a_failed_store_is_never_readable(monkeypatch):
    off, _ = offloader()
    h = hashes("a", 2)
    with off:

        def boom(*args, **kwargs):
            raise MemoryError("host memory exhausted")

        monkeypatch.setattr(off._pool, "write_blocks", boom)
        (result,) = off.wait([off.store(h, [1, 2])])
        assert not result.success and "MemoryError" in result.error
        assert off.lookup(h) == 0
        monkeypatch.undo()
        # The chunk went back to the store: a retry succeeds.
        assert off.wait([off.store(h, [1, 2])])[0].success
        assert off.lookup(h) == 2


def test_reset_with_jobs_in_flight_forgets_them():
    off, _ = offloader()
    h = hashes("a", 4)
    with off:
        off.wait([off.store(h, [1, 2, 3, 4])])
        load = off.load(h, [8, 9, 10, 11])
        store = off.store(hashes("b", 2), [5, 6])
        off.reset_cache()
        results = off.wait([load, store])
        assert all(r.success for r in results)
        assert off.lookup(h) == 0
        assert off.lookup(hashes("b", 2)) == 0


def test_sliding_window_groups_keep_only_their_window():
    # Window 8 tokens = 2 blocks = 1 chunk (bpc 2).
    cfg = config(window=8)
    assert cfg.groups[0].sliding_window_size_in_chunks == 1
    off, before = offloader(cfg)
    h = hashes("a", 6)
    with off:
        (result,) = off.wait([off.store(h, [1, 2, 3, 4, 5, 6])])
        assert result.size_bytes == 2 * BLOCK_BYTES  # only the last chunk
        assert off.lookup(h) == 6  # the window before the end is present
        assert off.lookup(h[:4]) == 0  # chunk 1 was not stored
        off.wait([off.load(h[4:6], [12, 13])])
        after = [np.asarray(a) for a in off.caches()]
    np.testing.assert_array_equal(after[0][12:14], before[0][5:7])


def test_bad_arguments():
    off, _ = offloader()
    with off:
        with pytest.raises(OffloaderError, match="one hash per block"):
            off.store(hashes("a", 2), [1])
        with pytest.raises(OffloaderError, match="group 3 is not offloaded"):
            off.lookup(hashes("a", 2), group=3)
        with pytest.raises(TypeError, match="block hashes must be bytes"):
            off.lookup(["x", "y"])
        with pytest.raises(ValueError, match="block ids must be in"):
            off.store(hashes("a", 2), [1, 99])
        # The refused offer gave its chunk back.
        assert off.wait([off.store(hashes("a", 2), [1, 2])])[0].success
    with pytest.raises(OffloaderError, match="cpu_bytes_to_use is required"):
        KVOffloader(
            config(extra={"cpu_bytes_to_use": None}),
            GroupCaches(arrays(), pk.KVLayout.nhd()),
        )


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["store", "load"]), st.integers(0, 5), st.integers(1, 3)),
        min_size=1,
        max_size=8,
    )
)
def test_random_sequences_match_a_dict_model(ops):
    """Whatever is loaded equals what was stored under that prefix, byte for byte."""
    off, _ = offloader(config(budget=3 * 4096))  # 3 chunks: evictions happen
    model: dict[bytes, list[np.ndarray]] = {}  # chunk key hash -> bytes of its 2 blocks
    with off:
        for op, prefix, chunks in ops:
            h = hashes(f"p{prefix}", 2 * chunks)
            if op == "store":
                src = list(range(2 * chunks))
                current = [np.asarray(a) for a in off.caches()]
                job = off.store(h, src)
                if job is not None:
                    assert off.wait([job])[0].success
                for c in range(chunks):
                    if off.lookup(h[: 2 * (c + 1)]) >= 2 * (c + 1):
                        model.setdefault(
                            h[2 * c + 1], [layer[2 * c : 2 * c + 2].copy() for layer in current]
                        )
            else:
                n = off.lookup(h)
                if n == 0:
                    continue
                dst = list(range(NB - n, NB))
                off.wait([off.load(h[:n], dst)])
                after = [np.asarray(a) for a in off.caches()]
                for c in range(n // 2):
                    expected = model[h[2 * c + 1]]
                    for layer in range(2):
                        got = after[layer][NB - n + 2 * c : NB - n + 2 * c + 2]
                        np.testing.assert_array_equal(got, expected[layer])


def test_canonical_layout_takes_global_arrays_and_refuses_shards():
    cfg = config(extra={"canonical_layout": True})
    assert cfg.canonical_layout
    with pytest.raises(OffloaderError, match="total_kv_heads"):
        offloader(cfg)
    shard = [a[:, :, :1] for a in arrays()]  # one of the two KV heads: a device's shard
    with pytest.raises(OffloaderError, match=r"has 1 KV heads .* model has 2"):
        KVOffloader(cfg, GroupCaches(shard, pk.KVLayout.nhd()), backend="xla", total_kv_heads=2)
    off, before = offloader(cfg, total_kv_heads=H)
    h = hashes("c", 4)
    with off:
        assert off.wait([off.store(h, [1, 2, 3, 4])])[0].success
        assert off.wait([off.load(h, [8, 9, 10, 11])])[0].success
        after = [np.asarray(a) for a in off.caches()]
    for layer in range(2):
        np.testing.assert_array_equal(after[layer][8:12], before[layer][1:5])
