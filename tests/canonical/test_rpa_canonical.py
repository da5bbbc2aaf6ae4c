"""Canonical pages of ragged-paged-attention v3 caches: stored on one mesh, loaded on
another (1, 2, 4, 8 simulated CPU devices, in `_rpa_mesh_script.py`), and the typed
refusals where a cache cannot have them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload import GroupCaches, KVOffloader, OffloaderError
from jax_kvoffload.transfer import TransferError, canonical_group_caches
from tests.canonical.rpa_common import hashes, rpa_bits, rpa_config, to_device

ROOT = Path(__file__).resolve().parents[2]


def _mesh_script(*args: str, timeout: int) -> subprocess.CompletedProcess:
    """`_rpa_mesh_script.py` in its own process (it sets 8 simulated devices), checked."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.canonical._rpa_mesh_script", *args],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.slow  # one process, 8 devices, 7 dtype/head cases x up to 16 mesh pairs: ~50 s
def test_rpa_prefix_moves_between_meshes_bit_for_bit():
    proc = _mesh_script(timeout=600)
    assert proc.stdout.split()[0] == "ok" and int(proc.stdout.split()[1]) >= 50


def test_sharded_rpa_caches_of_other_rows_are_refused_naming_the_shards():
    """fp8 caches packed for 4 shards, placed on 2 devices: the engine and the offloader
    (canonical or not) refuse them with typed errors that name the 2 shards and the
    shape those would need; on the 4 devices they were packed for they are accepted."""
    proc = _mesh_script("refusals", timeout=300)
    assert proc.stdout.split() == ["ok", "4"], proc.stdout


def test_canonical_rpa_pages_drop_the_padding_on_one_device():
    """fp8 with 3 heads on one device: 6 real slots in 8; host rows hold the 6 only, and
    a load keeps the target's 2 padding slots (noise) of every loaded block."""
    src = rpa_bits("fp8_e4m3", 3, 1, seed=0)
    cfg = rpa_config("fp8_e4m3", 3, canonical=True)
    h = hashes("one", 2)
    with KVOffloader(cfg, to_device(src), backend="xla", total_kv_heads=3) as off:
        assert off.wait([off.store(h, [3, 4])])[0].success
        target = rpa_bits("fp8_e4m3", 3, 1, seed=9)
        off.set_caches(to_device(target))
        assert off.wait([off.load(h, [0, 1])])[0].success
        out = [np.asarray(a).view(np.uint8) for a in off.caches()]
    for got, s, t in zip(out, src, target, strict=True):
        s, t = s.view(np.uint8), t.view(np.uint8)
        slots = got.reshape(*got.shape[:2], 8, 128)
        np.testing.assert_array_equal(slots[:2, :, :6], s.reshape(slots.shape)[3:5, :, :6])
        np.testing.assert_array_equal(slots[:2, :, 6:], t.reshape(slots.shape)[:2, :, 6:])
        np.testing.assert_array_equal(got[2:], t[2:])


def test_block_bytes_are_the_canonical_page():
    arrays = to_device(rpa_bits("fp8_e4m3", 3, 1, seed=1))
    plain = GroupCaches(arrays, "rpa")
    canon = canonical_group_caches(GroupCaches(arrays, "rpa"), 3)
    assert plain.block_bytes == 2 * 4 * 8 * 128  # layers x bs x (2 rows x 4 packing) x D
    assert canon.block_bytes == 2 * 4 * 6 * 128  # the real slots only
    assert canon.relays and not plain.relays


def test_refusals_are_typed_and_say_why():
    arrays = to_device(rpa_bits("bf16", 2, 1, seed=2))
    with pytest.raises(TransferError, match="for 3 KV heads"):  # rows do not fit H
        GroupCaches(arrays, "rpa", canonical_kv_heads=3)
    with pytest.raises(TransferError, match="for RPA caches"):
        flat = [a.reshape(a.shape[0], a.shape[1], -1, a.shape[4]) for a in arrays]
        GroupCaches(flat, "nhd", canonical_kv_heads=2)
    with pytest.raises(OffloaderError, match="total_kv_heads"):
        KVOffloader(rpa_config("bf16", 2, canonical=True), arrays, backend="xla")
    with pytest.raises(pk.LayoutError, match="divide"):  # 6 heads over 4 shards
        pk.rpa_cache_shape(4, 4, 6, 128, "bfloat16", shards=4)
    off_arrays = to_device(rpa_bits("bf16", 2, 1, seed=3))
    cfg = rpa_config("bf16", 2, canonical=True)
    off = KVOffloader(cfg, off_arrays, backend="xla", total_kv_heads=2)
    with off, pytest.raises(TransferError, match="for 2 KV heads"):
        off.set_caches(to_device(rpa_bits("bf16", 4, 1, seed=4)))


@pytest.mark.slow  # three interpreters, 6 offloaders each: ~1-2 min on 2 cores
def test_interpreters_move_bits_through_the_offloader_across_meshes():
    """Issue 21 item 3 end to end: -0.0 and NaN payloads stored on 2 devices, loaded on
    4 and 1 (the TPU interpreter changed fp16 NaN payloads here before the fix)."""
    backends = [b for b in ("tpu", "triton", "mosaic_gpu") if pk.get_backend(b).can_interpret()]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.canonical._interp_mesh_script", *backends],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-4000:]
