"""The demo's command line against sizes and tier values a user can type.

Before: sizes had no upper bound, so `demo --block-size 1000000000` imported jax
(8-17 s) and then asked XLA for about 100 TiB of KV cache, failing there (or swapping)
with no word of which flag; and a `--tier` URL of a misspelt scheme was echoed with its
password into the error (and so into logs). Now both are refused before jax is
imported, in the flags' terms, and a password is never printed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jax_kvoffload.cli import main
from jax_kvoffload.demo import DemoConfigError, DemoModelConfig, ScenarioConfig

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "import sys; from jax_kvoffload.cli import main; code = main(sys.argv[1:]); "
    "print('jax-imported' if 'jax' in sys.modules else 'no-jax', code)"
)


@pytest.mark.parametrize(
    "flags",
    [["--block-size", "1000000000"], ["--prompt-blocks", "100000000"],
     ["--layers", "100000", "--head-dim", "4096"], ["--vocab", "10000000000"],
     ["--suffix-tokens", "10000000000000"]],
)  # fmt: skip
def test_sizes_past_the_machines_memory_are_refused_before_jax(flags):
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, "demo", "--quiet", *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.stdout.split() == ["no-jax", "2"], proc.stderr[-2000:]
    assert "GiB" in proc.stderr and flags[0] in proc.stderr


def test_the_default_sizes_and_big_but_real_ones_pass():
    ScenarioConfig()
    ScenarioConfig(model=DemoModelConfig(num_layers=8, head_dim=128), block_size=64)
    with pytest.raises(DemoConfigError, match="block-size"):
        ScenarioConfig(block_size=2**40)


@pytest.mark.parametrize(
    "tier", ["redi://user:hunter2@127.0.0.1:6379", "http://:hunter2@host", "ftp://u:hunter2@[x"]
)
def test_a_bad_tier_url_never_prints_its_password(tier, capsys):
    assert main(["demo", "--quiet", "--tier", tier]) == 2
    err = capsys.readouterr().err
    assert "hunter2" not in err and "--tier" in err


@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--layers", "-1"], "--layers"), (["--kv-heads", "3"], "--kv-heads"),
     (["--prompt-blocks", "1", "--blocks-per-chunk", "4"], "--prompt-blocks")],
)  # fmt: skip
def test_a_bad_size_is_named_by_the_flag_that_was_typed(flags, named, capsys):
    # Before: "num_layers=-1 must be a positive int" for `--layers -1`.
    assert main(["demo", "--quiet", *flags]) == 2
    assert named in capsys.readouterr().err
