"""Interpret mode on caches spread over several devices never hangs (issue 12).

The TPU interpreter deadlocked on 8 CPU devices with 160 KiB shards and the Mosaic GPU
interpreter failed a cross-device barrier check and hung on 4; the API now runs such
calls one shard at a time on one device. Each case runs in a subprocess (it needs its
own device count) under a hard timeout, so a regression fails instead of hanging CI.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import pallas_kernels as pk

SCRIPT = pathlib.Path(__file__).with_name("sharded_interpret_run.py")
ROOT = SCRIPT.parents[2]
TIMEOUT_S = 240  # a pass takes 10-30 s on the 2-core CI machine

CASES = [  # backend, devices, KV heads (shard = 40 blocks x 16 x heads/devices x 64 x 2 B)
    ("tpu", 8, 16, "heads"),  # 160 KiB shards: the reported deadlock
    ("mosaic_gpu", 4, 4, "heads"),  # the reported barrier failure and hang
    ("tpu", 2, 2, "blocks"),  # sharded along blocks: the whole cache on one device
]


@pytest.mark.parametrize(("backend", "devices", "heads", "spec"), CASES)
def test_interpret_on_several_devices_finishes_bit_exact(backend, devices, heads, spec):
    if not pk.get_backend(backend).can_interpret():
        pytest.skip(f"this jax has no interpreter for {backend}")
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    env.pop("XLA_FLAGS", None)
    try:
        done = subprocess.run(
            [sys.executable, str(SCRIPT), backend, str(devices), str(heads), spec],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{backend} interpret on {devices} devices hung past {TIMEOUT_S} s: {exc}")
    assert done.returncode == 0 and done.stdout.startswith("OK"), done.stdout + done.stderr[-3000:]
