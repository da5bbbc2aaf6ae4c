"""The kernels' cached run-time zero (``mesh.run_time_zero``) outlives the arrays around it."""

from __future__ import annotations

import jax
import numpy as np

import pallas_kernels as pk
from pallas_kernels.blocks import api, mesh
from tests.pallas_kernels.bitmodel import DTYPES, bits_of

KW = {"layout": pk.KVLayout.nhd(), "backend": "xla"}


def _cache() -> jax.Array:
    bits = np.full((4, 2, 4, 2), 0x7F81, np.uint16)  # a bf16 NaN payload, kept bit for bit
    return jax.device_put(bits.view(DTYPES["bf16"]), jax.devices()[0])


def test_gather_and_scatter_work_after_every_live_array_was_deleted():
    # A sweep that frees a device (every live array deleted) also deleted the cached
    # zero, and every later gather or scatter raised "Array has been deleted".
    # Here only the zero is deleted, so that no other test's arrays go with it.
    cache = _cache()
    pk.gather_blocks([cache], np.array([0], np.int32), **KW)
    swept = mesh.run_time_zero([cache], api._ZERO)
    assert isinstance(swept, jax.Array)
    swept.delete()
    staging = pk.gather_blocks([cache], np.array([0, 2], np.int32), **KW)
    assert (bits_of(staging) == 0x7F81).all()
    out = pk.scatter_blocks([cache], np.array([1, 3], np.int32), staging, **KW)
    assert (bits_of(out[0]) == 0x7F81).all()


def test_uncommitted_caches_give_uncommitted_results():
    # The cached zero is committed to the caches' device: passed with uncommitted caches
    # it committed the staging and the scattered caches, which jax then refused to move
    # to meet arrays on another device.
    cache = jax.numpy.asarray(np.full((4, 2, 4, 2), 0x7F81, np.uint16).view(DTYPES["bf16"]))
    assert not cache.committed
    staging = pk.gather_blocks([cache], np.array([0, 2], np.int32), **KW)
    out = pk.scatter_blocks([cache], np.array([1, 3], np.int32), staging, **KW)
    assert not staging.committed and not out[0].committed
    assert (bits_of(out[0]) == 0x7F81).all()
