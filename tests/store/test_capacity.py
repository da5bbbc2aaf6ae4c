"""Host-tier sizing (vLLM's ``CPUOffloadingSpec``; cases F1-F4 of vLLM's
tests/v1/kv_offload/cpu/ spec tests, re-expressed for 0.33.0)."""

from __future__ import annotations

import pytest

from jax_kvoffload.store import CapacityError, HostStore, cpu_tier_capacity

P = 4096


@pytest.mark.parametrize("budget", [None, 0, "0"])
def test_f1_missing_or_zero_budget(budget):
    with pytest.raises(CapacityError, match="cpu_bytes_to_use must be specified"):
        cpu_tier_capacity(budget, worker_kv_bytes_per_block=P, blocks_per_chunk=1)


def test_f1_errors_are_value_errors_not_bare_exceptions():
    assert issubclass(CapacityError, ValueError)


def test_f2_rows_hold_every_worker_and_round_to_the_page():
    # 1000 B/block * 2 workers * 3 blocks = 6000 B -> one 8192 B row; 10 pages hold 5.
    cap = cpu_tier_capacity(
        10 * P, worker_kv_bytes_per_block=1000, blocks_per_chunk=3, world_size=2, page_size=P
    )
    assert (cap.num_chunks, cap.kv_bytes_per_chunk, cap.cpu_page_size_per_worker) == (
        5,
        8192,
        3000,
    )
    assert cap.cpu_kv_cache_size_bytes == 40960


def test_f3_no_kv_bytes_gives_zero_and_strings_parse():
    cap = cpu_tier_capacity(P, worker_kv_bytes_per_block=0, blocks_per_chunk=1)
    assert (cap.num_chunks, cap.kv_bytes_per_chunk, cap.cpu_page_size_per_worker) == (0, 0, 0)
    cap = cpu_tier_capacity("40960", worker_kv_bytes_per_block=P, blocks_per_chunk=1, page_size=P)
    assert cap.num_chunks == 10


def test_f4_replicated_layout_keeps_one_copy():
    kwargs = dict(worker_kv_bytes_per_block=P, blocks_per_chunk=1, world_size=4, page_size=P)
    assert cpu_tier_capacity(100 * P, **kwargs).kv_bytes_per_chunk == 4 * P
    replicated = cpu_tier_capacity(100 * P, replicated_layout=True, **kwargs)
    assert (replicated.num_chunks, replicated.cpu_page_size_per_worker) == (100, P)


def test_bad_values_and_types():
    with pytest.raises(CapacityError, match="must be > 0"):
        cpu_tier_capacity(-1, worker_kv_bytes_per_block=P, blocks_per_chunk=1)
    with pytest.raises(CapacityError, match="not a whole number"):
        cpu_tier_capacity("8GiB", worker_kv_bytes_per_block=P, blocks_per_chunk=1)
    with pytest.raises(TypeError, match="cpu_bytes_to_use must be an int"):
        cpu_tier_capacity(1.5e9, worker_kv_bytes_per_block=P, blocks_per_chunk=1)
    with pytest.raises(CapacityError, match="blocks_per_chunk=0 must be >= 1"):
        cpu_tier_capacity(P, worker_kv_bytes_per_block=P, blocks_per_chunk=0)
    with pytest.raises(TypeError, match="world_size must be an int"):
        cpu_tier_capacity(P, worker_kv_bytes_per_block=P, blocks_per_chunk=1, world_size=2.0)


def test_store_from_budget():
    m = HostStore.from_cpu_budget(
        3 * P, worker_kv_bytes_per_block=P // 2, blocks_per_chunk=2, eviction_policy="arc"
    )
    assert m.num_chunks == 3
    with pytest.raises(ValueError, match="num_chunks=-1 must be >= 0"):
        HostStore(-1)
    with pytest.raises(TypeError, match="num_chunks must be an int"):
        HostStore(2.0)  # type: ignore[arg-type]
