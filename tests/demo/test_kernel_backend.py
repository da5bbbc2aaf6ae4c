"""`demo --kernel-backend` offers what the pallas_kernels registry says this platform runs.

Issue 13: `--kernel-backend triton|mosaic_gpu` was offered on CPU from a hard-coded list
and died with a raw traceback; now anything else is refused before the model is built,
naming the backends that do run here.
"""

from __future__ import annotations

import io
import re
from contextlib import redirect_stderr

import pytest

import pallas_kernels as pk
from jax_kvoffload.cli import main
from jax_kvoffload.demo import DemoConfigError, ScenarioConfig

NOT_HERE = [b.name for b in pk.list_backends() if b.name not in pk.supported_backends()]


@pytest.mark.parametrize("backend", ["auto", *pk.supported_backends()])
def test_backends_this_platform_runs_are_accepted(backend):
    assert ScenarioConfig(kernel_backend=backend).kernel_backend == backend


@pytest.mark.parametrize("backend", NOT_HERE)
def test_backends_this_platform_does_not_run_are_refused(backend):
    runs = ("auto", *pk.supported_backends())
    with pytest.raises(DemoConfigError, match="needs .*" + re.escape(f"choose one of {runs!r}")):
        ScenarioConfig(kernel_backend=backend)


@pytest.mark.parametrize("backend", ["nope", "XLA", 3])
def test_unknown_backends_are_refused(backend):
    with pytest.raises(DemoConfigError, match="kernel_backend="):
        ScenarioConfig(kernel_backend=backend)


@pytest.mark.parametrize("backend", [*NOT_HERE[:1], "nope"])
def test_cli_exits_2_with_one_line_not_a_traceback(backend):
    err = io.StringIO()
    with redirect_stderr(err):
        assert main(["demo", "--kernel-backend", backend, "--quiet"]) == 2
    text = err.getvalue()
    assert text.startswith("error: kernel_backend=") and "Traceback" not in text
    assert "xla" in text


def test_cli_help_names_the_registry(capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--help"])
    assert info.value.code == 0
    assert "supported_backends()" in " ".join(capsys.readouterr().out.split())
