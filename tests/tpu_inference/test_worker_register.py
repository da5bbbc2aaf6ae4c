"""`StoreWorker.register_runner` called twice (a runner rebuilt in place): the chunks the
store lists stay served with their bytes, or the call is refused. Fast, without
tpu-inference: the worker is driven with their metadata's fields on plain objects.
Before the fix a second call built a new, empty pool (and leaked the first engine): the
store's chunks then loaded as zeros."""

from __future__ import annotations

from types import SimpleNamespace as NS

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload.bridge.tpu_inference._errors import (
    TPUConnectorConfigError,
    TPUConnectorStateError,
)
from jax_kvoffload.bridge.tpu_inference._hub import Hub
from jax_kvoffload.bridge.tpu_inference._worker import StoreWorker
from jax_kvoffload.config import host_tier_config
from jax_kvoffload.store import HostStore


class Stats:
    """Their `KVOffloadConnectorStats`' calls the worker makes."""

    def __init__(self):
        self.saves, self.loads = [], []

    def record_save(self, req, saved_chunk_ids):
        self.saves.append((req, saved_chunk_ids))

    def record_load(self, req, loaded_chunk_ids):
        self.loads.append((req, loaded_chunk_ids))

    def is_empty(self):
        return not (self.saves or self.loads)

    def clone_and_reset(self):
        out = (self.saves, self.loads)
        self.saves, self.loads = [], []
        return out


class Connector:
    def __init__(self):
        self.meta = []

    def _get_connector_metadata(self):
        return NS(requests_meta=self.meta)


def _caches(rng, heads=2, layers=2):
    shape = pk.rpa_cache_shape(8, 4, heads, 128, jnp.bfloat16)
    bits = [rng.integers(0, 1 << 16, shape, dtype=np.uint16) for _ in range(layers)]
    return [jnp.asarray(b.view(jnp.bfloat16)) for b in bits]


def _worker():
    hub = Hub(host=host_tier_config({}), num_chunks=4)
    hub.store = HostStore(4)
    conn = Connector()
    return StoreWorker(hub, conn, Stats(), "m", 4), conn, hub


def test_a_second_registration_keeps_the_saved_chunks():
    rng = np.random.default_rng(0)
    w, conn, hub = _worker()
    runner = NS(kv_caches=_caches(rng))
    w.register_runner(runner)
    src = [np.asarray(a).view(np.uint16).copy() for a in runner.kv_caches]
    save = NS(skip_save=False, is_final_save=False, src_blocks=[1, 2], dst_chunks=[0, 1])
    conn.meta = [NS(req_id="a", load_spec=None, save_spec=save)]
    w.start_save_kv()
    hub.engine.wait([1])
    rebuilt = NS(kv_caches=_caches(rng))  # the rebuilt runner: same geometry, other bits
    w.register_runner(rebuilt)
    assert hub.engine is not None and w._engine is hub.engine  # the first pool and engine
    load = NS(can_load=True, dst_blocks=[5, 6], src_chunks=[0, 1])
    conn.meta = [NS(req_id="b", save_spec=None, load_spec=load)]
    w.start_load_kv()
    for got, s in zip(rebuilt.kv_caches, src, strict=True):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16)[5:7], s[1:3])
    hub.close()


def test_a_second_registration_of_another_geometry_is_refused():
    rng = np.random.default_rng(1)
    w, _, hub = _worker()
    w.register_runner(NS(kv_caches=_caches(rng)))
    with pytest.raises(TPUConnectorStateError, match="another geometry"):
        w.register_runner(NS(kv_caches=_caches(rng, heads=4)))
    with pytest.raises(TPUConnectorStateError, match="another geometry"):
        w.register_runner(NS(kv_caches=_caches(rng, layers=3)))
    hub.close()


def test_a_load_spec_whose_blocks_and_chunks_do_not_pair_is_refused():
    # Two requests, 3 blocks / 2 chunks and 1 block / 2 chunks: 4 and 4 in all, so the
    # engine saw nothing wrong and loaded chunk 2 into block 7, chunk 3 into block 0.
    rng = np.random.default_rng(2)
    w, conn, hub = _worker()
    runner = NS(kv_caches=_caches(rng))
    w.register_runner(runner)
    save = NS(
        skip_save=False, is_final_save=False, src_blocks=[1, 2, 3, 4], dst_chunks=[0, 1, 2, 3]
    )
    conn.meta = [NS(req_id="a", load_spec=None, save_spec=save)]
    w.start_save_kv()
    hub.engine.wait([1])
    before = [np.asarray(a).view(np.uint16).copy() for a in runner.kv_caches]
    x = NS(can_load=True, dst_blocks=[5, 6, 7], src_chunks=[0, 1])
    y = NS(can_load=True, dst_blocks=[0], src_chunks=[2, 3])
    conn.meta = [NS(req_id=r, save_spec=None, load_spec=s) for r, s in (("x", x), ("y", y))]
    with pytest.raises(TPUConnectorStateError, match="request x: load_spec has 3 dst_blocks"):
        w.start_load_kv()
    for got, b in zip(runner.kv_caches, before, strict=True):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), b)
    # Reported all the same (nothing loaded): the scheduler side gives the pins back.
    assert w._stats.loads == [("x", [0, 1]), ("y", [2, 3])]
    hub.close()


@pytest.mark.parametrize("geometry", [(6, 4), (8, 8)], ids=["num_blocks", "block_size"])
def test_layers_of_another_block_geometry_are_refused(geometry):
    # A hybrid model's second page shape was accepted with layer 0's (num_blocks,
    # block_size) reported for it; a block id then named no block, or half of one.
    rng = np.random.default_rng(3)
    other = jnp.zeros(pk.rpa_cache_shape(*geometry, 4, 128, jnp.bfloat16), jnp.bfloat16)
    w, _, hub = _worker()
    with pytest.raises(TPUConnectorConfigError, match=r"kv_caches\[1\].shape"):
        w.register_runner(NS(kv_caches=[_caches(rng)[0], other]))
    hub.close()
