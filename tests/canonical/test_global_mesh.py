"""JAX-native canonical pages from global arrays sharded over 1-8 simulated CPU devices.

Runs `_mesh_script.py` in a subprocess: XLA's device count is fixed when jax initialises,
and this pytest process already initialised it with one device."""

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


def test_same_chunks_from_every_mesh():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.canonical._mesh_script"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split()[-2:] == ["ok", "15"], proc.stdout


def test_a_per_device_shard_is_not_a_global_view():
    shard = GroupCaches([jnp.zeros((4, 4, 2, 8), jnp.bfloat16)], pk.KVLayout.nhd())
    with pytest.raises(TransferError, match=r"2 KV heads .* model has 8"):
        check_global_caches(shard, 8)
    check_global_caches(shard, 2)
    mla = GroupCaches([jnp.asarray(np.zeros((4, 4, 16), np.float32))], pk.KVLayout.mla())
    check_global_caches(mla, 8)
