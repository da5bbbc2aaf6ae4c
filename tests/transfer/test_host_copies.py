"""The JAX engine's host copies, counted by the pools (`HostPool.host_copies`) on the code
path an accelerator takes (`device_path=True`: stores `device_put` into pinned host
memory on CPU too): the pinned-row pool copies no KV byte with the CPU in either
direction; the numpy pool copies each byte exactly once per direction (docs/kernels.md,
"Data path"). A change that adds a host copy to either path fails here."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload.hostmem import HostChunkPool, PinnedRowPool
from jax_kvoffload.transfer import GroupCaches, GroupTransfer, TransferEngine

from .test_engine import random_arrays

NB, BPC = 16, 2
SHAPE = (NB, 4, 2, 8)


def engine_with(pool_cls, *, device_path=True, max_bucket=4):
    arrays = random_arrays(SHAPE, np.uint16, 2, seed=3)
    gc = GroupCaches(arrays, pk.KVLayout.nhd())
    pool = pool_cls(8, {0: gc.block_bytes}, BPC)
    engine = TransferEngine(
        {0: gc}, pool, backend="xla", max_bucket=max_bucket, device_path=device_path
    )
    return engine, pool, gc.block_bytes, [np.asarray(a).copy() for a in arrays]


def round_trip(engine, blocks, chunks, targets, first_slot=0):
    engine.submit_store(1, [GroupTransfer(0, tuple(blocks), tuple(chunks), first_slot)])
    assert engine.wait([1])[0].success
    stored = engine_pool_copies(engine)
    engine.submit_load(2, [GroupTransfer(0, tuple(targets), tuple(chunks), first_slot)])
    assert engine.wait([2])[0].success
    return stored, engine_pool_copies(engine)


def engine_pool_copies(engine):
    return engine._pool.host_copies.snapshot()


def check_loaded(engine, before, blocks, targets):
    after = [np.asarray(a) for a in engine.arrays(0)]
    for layer in range(2):
        np.testing.assert_array_equal(after[layer][targets], before[layer][blocks])


@pytest.mark.parametrize("device_path", [True, False])
def test_pinned_rows_copy_nothing_with_the_cpu(device_path):
    engine, pool, _, before = engine_with(PinnedRowPool, device_path=device_path)
    blocks, targets = [3, 9, 1, 14, 6, 0], [2, 4, 5, 7, 8, 10]
    stored, loaded = round_trip(engine, blocks, [4, 0, 2], targets)
    assert stored == (0, 0) and loaded == (0, 0)
    check_loaded(engine, before, blocks, targets)
    assert (pool.adopted, pool.copied) == (3, 0)
    # The rows a load reads are the store's host arrays themselves: pinned host memory
    # on the accelerator path (what the H2D copy reads without staging).
    ((row, k0, k1),) = pool.row_sources(0, [4], 0, BPC)
    assert (k0, k1) == (0, BPC)
    on_cpu = jax.devices()[0].platform == "cpu"  # (gpu_check.sh runs this on a GPU too)
    want = "pinned_host" if device_path or not on_cpu else "device"
    assert row.sharding.memory_kind == want
    engine.close()


def test_numpy_rows_copy_each_byte_once_per_direction():
    engine, _, block_bytes, before = engine_with(HostChunkPool)
    blocks, targets = [3, 9, 1, 14, 6], [2, 4, 5, 7, 8]  # 5 blocks: two pieces of 4 + 1
    stored, loaded = round_trip(engine, blocks, [4, 0, 2], targets)
    n = len(blocks) * block_bytes
    assert stored == (n, 0)  # write_blocks: the D2H staging into the rows
    assert loaded == (n, n)  # read_blocks: the rows into the H2D staging
    check_loaded(engine, before, blocks, targets)
    engine.close()


def test_pinned_rows_copy_only_partial_chunks():
    """A store that starts mid-chunk is copied into a row of the chunk's own (its other
    bytes kept); the whole chunks around it are adopted. Documented: the partial
    piece's bytes, plus the old row when the chunk held one."""
    engine, pool, block_bytes, before = engine_with(PinnedRowPool)
    blocks, targets = [3, 9, 1], [2, 4, 5]
    stored, loaded = round_trip(engine, blocks, [4, 0], targets, first_slot=1)
    assert (pool.adopted, pool.copied) == (1, 1)
    assert stored == (block_bytes, 0)  # slot 1 of chunk 4: one block, no old row
    assert loaded == stored  # the load reads both rows as they are
    check_loaded(engine, before, blocks, targets)
    engine.submit_store(3, [GroupTransfer(0, (7,), (4,), 1)])  # chunk 4 again, slot 1
    assert engine.wait([3])[0].success
    assert engine_pool_copies(engine) == (block_bytes + BPC * block_bytes + block_bytes, 0)
    engine.close()


@pytest.mark.parametrize("pool_cls", [PinnedRowPool, HostChunkPool])
def test_a_job_is_one_device_put_per_direction(pool_cls, monkeypatch):
    engine, _, _, before = engine_with(pool_cls, max_bucket=2)  # pieces of <= 2 blocks
    blocks, targets = [3, 9, 1, 14, 6, 0], [2, 4, 5, 7, 8, 10]
    calls = []
    real = jax.device_put

    def counted(x, *args, **kw):
        calls.append(len(x) if isinstance(x, list) else 1)
        return real(x, *args, **kw)

    monkeypatch.setattr(jax, "device_put", counted)
    engine.submit_store(1, [GroupTransfer(0, tuple(blocks), (4, 0, 2))])
    assert engine.wait([1])[0].success
    assert calls == [3]  # three pieces (one per chunk), one dispatch
    engine.submit_load(2, [GroupTransfer(0, tuple(targets), (4, 0, 2))])
    assert engine.wait([2])[0].success
    assert calls == [3, 3]
    check_loaded(engine, before, blocks, targets)
    engine.close()


SHARDED = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import pallas_kernels as pk
from jax_kvoffload.hostmem import PinnedRowPool
from jax_kvoffload.transfer import GroupCaches, GroupTransfer, TransferEngine

mesh = Mesh(np.array(jax.devices()), ("tp",))
bits = np.random.default_rng(0).integers(0, 2**16, (8, 4, 8, 16), dtype=np.uint16)
heads = NamedSharding(mesh, P(None, None, "tp", None))
for device_path in (True, False):
    arrays = [jax.device_put(np.roll(bits, k), heads) for k in range(2)]
    before = [np.asarray(a).copy() for a in arrays]
    gc = GroupCaches(arrays, pk.KVLayout.nhd())
    pool = PinnedRowPool(4, {0: gc.block_bytes}, 2)
    with TransferEngine({0: gc}, pool, backend="xla", device_path=device_path) as engine:
        engine.submit_store(1, [GroupTransfer(0, (2, 5, 7, 1), (3, 0))])
        assert engine.wait([1])[0].success
        engine.submit_load(2, [GroupTransfer(0, (0, 3, 4, 6), (3, 0))])
        assert engine.wait([2])[0].success
        after = [np.asarray(a) for a in engine.arrays(0)]
        assert engine.arrays(0)[0].sharding.is_equivalent_to(heads, 4)
    for k in range(2):
        np.testing.assert_array_equal(after[k][[0, 3, 4, 6]], before[k][[2, 5, 7, 1]])
    assert pool.host_copies.snapshot() == (0, 0), pool.host_copies
print("OK")
"""


def test_sharded_caches_through_pinned_rows_copy_nothing_with_the_cpu():
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", SHARDED], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and "OK" in run.stdout, run.stderr[-3000:]


def test_a_chunk_two_pieces_of_a_load_share_crosses_the_bus_once(monkeypatch):
    engine, pool, _, before = engine_with(PinnedRowPool, max_bucket=4)
    blocks = [3, 9, 1, 14, 6, 0, 11, 12]
    engine.submit_store(1, [GroupTransfer(0, tuple(blocks), (4, 0, 2, 5))])
    assert engine.wait([1])[0].success
    calls = []
    real = jax.device_put

    def counted(x, *args, **kw):
        calls.append(len(x))
        return real(x, *args, **kw)

    monkeypatch.setattr(jax, "device_put", counted)
    # Slots 1-6: pieces of 4 + 2 blocks; chunk 2 (slots 4-5) is in both.
    targets = [2, 4, 5, 7, 8, 10]
    engine.submit_load(2, [GroupTransfer(0, tuple(targets), (4, 0, 2, 5), 1)])
    assert engine.wait([2])[0].success
    assert calls == [4]  # four chunks' rows, each once
    after = [np.asarray(a) for a in engine.arrays(0)]
    for layer in range(2):
        np.testing.assert_array_equal(after[layer][targets], before[layer][blocks[1:7]])
    assert pool.host_copies.snapshot() == (0, 0)
    engine.close()
