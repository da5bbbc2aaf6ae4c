"""JAX-native canonical pages from global arrays sharded over 1-8 simulated CPU devices.

Runs `_mesh_script.py` and `_remesh_script.py` in subprocesses (each sets its device
count): XLA's device count is fixed when jax initialises, and this pytest process already
initialised it with one device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload.transfer import GroupCaches, TransferError, check_global_caches

ROOT = Path(__file__).resolve().parents[2]


def run_script(module: str) -> list[str]:
    """Runs `python -m <module>` from the checkout; returns its output words."""
    proc = subprocess.run(
        [sys.executable, "-m", module],
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.split()


@pytest.mark.slow  # one process per mesh size: ~14 s on 2 idle cores
def test_same_chunks_from_every_mesh():
    assert run_script("tests.canonical._mesh_script")[-2:] == ["ok", "15"]


def test_a_prefix_stored_on_2_devices_loads_on_4_and_on_1():
    # The engine changes its TP size at run time and keeps its offloaded prefix.
    assert run_script("tests.canonical._remesh_script")[-1:] == ["ok"]


def test_a_per_device_shard_is_not_a_global_view():
    shard = GroupCaches([jnp.zeros((4, 4, 2, 8), jnp.bfloat16)], pk.KVLayout.nhd())
    with pytest.raises(TransferError, match=r"2 KV heads .* model has 8"):
        check_global_caches(shard, 8)
    check_global_caches(shard, 2)
    mla = GroupCaches([jnp.asarray(np.zeros((4, 4, 16), np.float32))], pk.KVLayout.mla())
    check_global_caches(mla, 8)
