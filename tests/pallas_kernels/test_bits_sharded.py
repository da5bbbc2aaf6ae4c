"""Every backend moves bits on caches sharded over several devices (issue 21, item 3).

The bit model of test_bits_random.py, on caches spread over meshes of 1-8 simulated CPU
devices (``sharded_bits_run.py``, in a subprocess: it needs its own device count): every
layout (the ragged-paged-attention v3 one included) and float dtype, NaN payloads, -0.0
and subnormals, sharded along heads, along blocks, over a two-axis mesh and replicated,
for the XLA and reference backends and every interpreter (TPU, Triton, Mosaic GPU).
The seed is printed; replay with ``PK_BITS_SEED``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

import pallas_kernels as pk

SCRIPT = pathlib.Path(__file__).with_name("sharded_bits_run.py")
ROOT = SCRIPT.parents[2]
SEED = int(os.environ.get("PK_BITS_SEED", time.time_ns() % 2**31))
INTERPRETED = [b for b in ("tpu", "triton", "mosaic_gpu") if pk.get_backend(b).can_interpret()]


def run(backends: list[str], cases: int | None, timeout: int) -> None:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env.pop("XLA_FLAGS", None)
    mode = ["hazard"] if cases is None else [str(SEED), str(cases)]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *mode, *backends],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0 and "OK" in done.stdout, (
        f"PK_BITS_SEED={SEED}: " + done.stdout[-3000:] + done.stderr[-3000:]
    )


@pytest.mark.slow  # ~55 s on the 2-core machine (three interpreters, one subprocess)
def test_reported_class_on_every_backend():
    """-0.0, NaN payloads and subnormals only, heads sharded over 4 devices, staging on
    the devices: the TPU interpreter returned 0x7C01 -> 0x7E00 (fp16) before the
    shard-by-shard scatter sliced its staging as integers."""
    run(["xla", "reference", *INTERPRETED], None, 600)


def test_compiled_backends_move_bits_on_sharded_caches():
    run(["xla", "reference"], 4, 600)


@pytest.mark.slow  # ~1 min on the 2-core machine
@pytest.mark.skipif(not INTERPRETED, reason="this jax has no Pallas interpreter")
def test_interpreters_move_bits_on_sharded_caches():
    run(INTERPRETED, 2, 600)


@pytest.mark.slow  # ~2-4 min on the 2-core machine
def test_many_sharded_cases_on_every_backend():
    run(["xla", "reference", *INTERPRETED], 12, 900)
