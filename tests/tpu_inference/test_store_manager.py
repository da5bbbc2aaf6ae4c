"""`StoreManager`: tpu-inference's `LRUCacheManager` calls on our `HostStore`.

Fast, without tpu-inference: the manager is plain Python over our store. Each test is
one rule of their manager (offload/offload_manager.py, 0.32.0) their scheduler relies
on, checked on ours; the harness (test_harness.py) drives it under their scheduler.
"""

from __future__ import annotations

import pytest

from jax_kvoffload.bridge.tpu_inference._errors import UnknownChunkError
from jax_kvoffload.bridge.tpu_inference._hub import Hub
from jax_kvoffload.bridge.tpu_inference._manager import StoreManager
from jax_kvoffload.config import host_tier_config
from jax_kvoffload.store import HostStore, LookupResult, make_offload_key


def _manager(num_chunks: int = 4) -> tuple[StoreManager, Hub]:
    hub = Hub(host=host_tier_config({}), num_chunks=num_chunks)
    hub.store = HostStore(num_chunks)
    return StoreManager(hub), hub


H = [bytes([i]) * 32 for i in range(10)]


def _save(m: StoreManager, hashes: list[bytes]) -> list[int]:
    chunks, _ = m.allocate_for_save(hashes)
    ids = [c.chunk_id for c in chunks]
    m.mark_completion(ids, "save")
    return ids


def test_lookup_counts_leading_ready_chunks_only():
    m, _ = _manager()
    _save(m, H[:2])
    chunks, _ = m.allocate_for_save([H[2]])  # write-pending: not loadable yet
    assert m.lookup(H[:4]) == 2
    m.mark_completion([chunks[0].chunk_id], "save")
    assert m.lookup(H[:4]) == 3
    assert m.lookup([H[5], *H[:3]]) == 0  # a leading miss: nothing counts


def test_allocate_for_save_returns_new_chunks_and_their_positions():
    m, _ = _manager()
    _save(m, [H[1]])
    chunks, positions = m.allocate_for_save(H[:3])
    assert positions == [0, 2]  # H[1] is present: skipped, as theirs
    assert len({c.chunk_id for c in chunks}) == 2
    assert m.allocate_for_save([H[1]]) is None  # nothing new: None, as theirs


def test_no_room_is_none_and_pins_and_pending_saves_are_never_evicted():
    m, hub = _manager(num_chunks=2)
    _save(m, H[:2])
    m.prepare_load([H[0]])  # pinned
    pending, _ = m.allocate_for_save([H[2]])  # evicts H[1], the only idle chunk
    assert hub.store.lookup(make_offload_key(H[1], 0)) is LookupResult.MISS
    assert m.allocate_for_save([H[3]]) is None  # H[0] pinned, H[2] write-pending
    m.mark_completion([pending[0].chunk_id], "save")
    assert m.lookup([H[0], H[2]]) == 2


def test_a_load_pins_until_its_completion():
    m, _ = _manager(num_chunks=1)
    (chunk,) = _save(m, [H[0]])
    (pinned,) = m.prepare_load([H[0]])
    assert pinned.chunk_id == chunk
    assert m.allocate_for_save([H[1]]) is None
    m.mark_completion([chunk], "load")
    assert m.allocate_for_save([H[1]]) is not None  # evictable again


def test_a_failed_save_frees_its_chunk_instead():
    m, hub = _manager()
    chunks, _ = m.allocate_for_save(H[:2])
    ids = [c.chunk_id for c in chunks]
    hub.fail_saves([ids[1]])
    m.mark_completion(ids, "save")
    assert m.lookup(H[:2]) == 1
    assert hub.store.lookup(make_offload_key(H[1], 0)) is LookupResult.MISS
    assert hub.store.num_free_chunks == 3


def test_touch_keeps_recent_chunks_from_eviction():
    m, _ = _manager(num_chunks=2)
    _save(m, [H[0]])
    _save(m, [H[1]])
    m.touch([H[0]])  # H[0] now most recent: H[1] is evicted first
    _save(m, [H[2]])
    assert m.lookup([H[0]]) == 1 and m.lookup([H[1]]) == 0


def test_unknown_operation_is_a_typed_error():
    m, _ = _manager()
    ids = _save(m, [H[0]])
    with pytest.raises(Exception, match="'save' or 'load' expected"):
        m.mark_completion(ids, "copy")


def test_completing_an_unknown_chunk_is_refused_before_anything_changes():
    """Theirs raises ValueError for an id it never allocated; ours too, typed."""
    m, _ = _manager()
    chunks, _ = m.allocate_for_save([H[0]])
    with pytest.raises(UnknownChunkError, match=r"mark_completion\(\[\d+, 999\], 'save'\)"):
        m.mark_completion([chunks[0].chunk_id, 999], "save")
    assert isinstance(UnknownChunkError("save", [1], [1]), ValueError)
    assert m.lookup([H[0]]) == 0  # still write-pending: nothing was completed


def _tiered(tier_dir, rows: int = 4):
    from jax_kvoffload.hostmem import build_host_pool
    from jax_kvoffload.tiers import DiskTier, DiskTierConfig

    m, hub = _manager(rows)
    pool, _ = build_host_pool(rows, {0: 64}, 1)
    tier = DiskTier(DiskTierConfig(path=str(tier_dir), capacity_bytes=1 << 20), bytes(32))
    hub.attach_worker(pool, None, (tier,), 1)
    return m, hub, pool


def test_saves_cascade_to_a_tier_and_a_fresh_store_is_served_from_it(tmp_path):
    """Fast, without tpu-inference: what the harness's tier scenarios check across
    processes, on the manager alone (a fresh store, pool and tier over one directory)."""
    m, hub, pool = _tiered(tmp_path / "tier")
    chunks, _ = m.allocate_for_save(H[:2])
    ids = [c.chunk_id for c in chunks]
    for i, c in enumerate(ids):
        pool.chunk_row_for_write(0, c)[:] = i + 1  # what the worker's save wrote
    m.mark_completion(ids, "save")
    assert hub.tier_path().wait(timeout=30)
    hub.close()

    fresh, hub2, pool2 = _tiered(tmp_path / "tier")
    assert fresh.lookup(H[:3]) == 2  # promoted from the tier before it is counted
    loaded = fresh.prepare_load(H[:2])
    for i, c in enumerate(loaded):
        assert (pool2.chunk_row(0, c.chunk_id) == i + 1).all()
    hub2.close()


def test_a_repeated_hash_gets_one_chunk_and_leaks_none():
    # Before: two chunks for one key, the first kept by no key and never freed, so a
    # 2-chunk store could not take two new hashes again.
    m, _ = _manager(num_chunks=2)
    chunks, positions = m.allocate_for_save([H[0], H[1], H[0]])
    assert len(chunks) == 2 and positions == [0, 1]
    m.mark_completion([c.chunk_id for c in chunks], "save")
    assert m.lookup([H[0], H[1]]) == 2
    again, _ = m.allocate_for_save([H[2], H[2], H[3]])  # both evicted, none leaked
    assert len({c.chunk_id for c in again}) == 2
