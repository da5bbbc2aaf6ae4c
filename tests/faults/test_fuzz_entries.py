"""Garbage at every public entry: each call returns or raises an error of the library's
root (`KVOffloadError`), never an AttributeError, IndexError, ZeroDivisionError or a
raw numpy/int() message from deep inside; and the objects keep working afterwards."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload import GroupCaches
from jax_kvoffload.errors import KVOffloadError
from jax_kvoffload.hostmem import HostChunkPool
from jax_kvoffload.store import StoreError
from jax_kvoffload.transfer import GroupTransfer, TransferEngine
from tests.faults._helpers import NB, hashes, noise, offloader, pins, write_blocks

STORE_ERRORS = () if issubclass(StoreError, KVOffloadError) else (StoreError,)
H = hashes("f", 4)
ODD = [
    None, True, 1.5, float("nan"), -1, 2**70, "x", b"x", "", [], [None], [1.5], ["a"],
    [True, 1], [[1, 2]], {}, {0: 1}, (1, 2), range(3), object(), np.float32(1),
    np.array([[1]]), np.array([1.0, 2.0]), np.array(["a"]), np.int64(1), [-1, 2], [0, NB],
    [2**63, 1], H, H[:2], [H[0], "x"], [1, 2], [1, 2, 3, 4],
]  # fmt: skip


def calls_on_offloader(off):
    yield "store", lambda a, b: off.store(a, b)
    yield "load", lambda a, b: off.load(a, b)
    yield "lookup", lambda a, b: off.lookup(a, group=b)
    yield "wait", lambda a, b: off.wait(a)
    yield "caches", lambda a, b: off.caches(a)
    yield "set_caches", lambda a, b: off.set_caches(a, group=b)
    yield "store(group)", lambda a, b: off.store(H[:2], [1, 2], group=a)


def calls_on_engine(e):
    yield "submit_store", lambda a, b: e.submit_store(a, b)
    yield "submit_load", lambda a, b: e.submit_load(1, [GroupTransfer(0, a, b)])
    yield "submit_store(slot)", lambda a, b: e.submit_store(1, [GroupTransfer(0, (1,), (0,), a)])
    yield "wait", lambda a, b: e.wait(a)
    yield "join", lambda a, b: e.join(a)
    yield "arrays", lambda a, b: e.arrays(a)
    yield "set_arrays", lambda a, b: e.set_arrays(a, b)
    yield "discard", lambda a, b: e.discard(a)


def constructors():
    gc = GroupCaches(noise(), pk.KVLayout.nhd())
    pool = HostChunkPool(4, {0: gc.block_bytes}, 2)
    yield "GroupCaches", lambda a, b: GroupCaches(a, b)
    yield "GroupCaches(arrays)", lambda a, b: GroupCaches(a, pk.KVLayout.nhd())
    yield "HostChunkPool", lambda a, b: HostChunkPool(a, b, 2)
    yield "HostChunkPool(bpc)", lambda a, b: HostChunkPool(4, {0: 8}, a)
    yield "check_chunks", lambda a, b: pool.check_chunks(a)
    yield "TransferEngine", lambda a, b: TransferEngine(a, pool).close()
    yield "TransferEngine(kw)", lambda a, b: TransferEngine({0: gc}, pool, max_bucket=a).close()


def attempt(name, call, a, b):
    try:
        call(a, b)
    except (KVOffloadError, *STORE_ERRORS):
        pass
    except Exception as e:
        pytest.fail(f"{name}({a!r:.40}, {b!r:.40}) raised {type(e).__name__}: {e}")


@pytest.mark.parametrize("seed", range(2))
def test_garbage_at_offloader_entries(seed):
    rng = np.random.default_rng(seed)
    print(f"seed={seed}")
    off = offloader()
    write_blocks(off, [1, 2, 3, 4], H)
    assert off.wait([off.store(H, [1, 2, 3, 4])])[0].success
    for name, call in calls_on_offloader(off):
        for a, b in itertools.product(ODD, [None, 0, 1.5, "x"]):
            if rng.random() < 0.5:
                attempt(name, call, a, b)
    off.wait()
    assert pins(off) == (0, 0) and off.lookup(H) == 4
    assert off.wait([off.load(H, [10, 11, 12, 13])])[0].success
    off.close()


def test_garbage_at_engine_entries_and_constructors():
    gc = GroupCaches(noise(), pk.KVLayout.nhd())
    with TransferEngine({0: gc}, HostChunkPool(4, {0: gc.block_bytes}, 2), backend="xla") as e:
        for name, call in calls_on_engine(e):
            for a, b in itertools.product(ODD, [None, [], [jnp.zeros(3)], 0]):
                attempt(name, call, a, b)
        e.join()
        e.get_finished()
        e.submit_store(10**6, [GroupTransfer(0, (1,), (0,))])
        assert e.wait([10**6])[0].success
    for name, call in constructors():
        for a, b in itertools.product(ODD, [None, pk.KVLayout.nhd(), {0: 8}]):
            attempt(name, call, a, b)
