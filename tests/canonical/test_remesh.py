"""A JAX engine changes its TP size at run time and keeps its offloaded prefix.

Runs `_remesh_script.py` in a subprocess (4 simulated CPU devices; this pytest process
already initialised jax with one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_prefix_stored_on_2_devices_loads_on_4_and_on_1():
    proc = subprocess.run(
        [sys.executable, "-m", "tests.canonical._remesh_script"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split()[-1:] == ["ok"], proc.stdout
