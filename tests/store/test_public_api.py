"""The public surface: every exported name resolves; the store stays pure Python."""

from __future__ import annotations

import subprocess
import sys

import jax_kvoffload.store as store


def test_all_names_resolve():
    for name in store.__all__:
        assert getattr(store, name) is not None, name


def test_store_imports_neither_jax_nor_torch():
    # numpy comes in with the error root (jax_kvoffload.errors lives beside config,
    # which imports numpy); the scheduler process has it anyway.
    code = (
        "import sys, jax_kvoffload.store; "
        "bad = [m for m in ('jax', 'torch', 'vllm') if m in sys.modules]; "
        "print(','.join(bad))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == ""
