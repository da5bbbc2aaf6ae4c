"""benchmarks/tpu_inference.py refuses nonsense arguments before it imports anything heavy.

Only the parser runs here (the benchmark itself needs tpu-inference: docs/tpu_inference.md).
"""

from __future__ import annotations

import sys

import pytest

from tests.test_benchmark_args import load


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--repeats", "0"], "--repeats: must be an integer >= 1, got 0"),
        (["--blocks", "4", "-1"], "--blocks: must be an integer >= 1, got -1"),
        (["--layers", "two"], "--layers: must be an integer >= 1, got 'two'"),
        (["--dtype", "float4"], "--dtype: invalid choice: 'float4'"),
    ],
)
def test_nonsense_is_refused_with_the_rule(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        load("tpu_inference").parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_sensible_arguments_parse_without_importing_tpu_inference():
    before = "tpu_inference" in sys.modules
    args = load("tpu_inference").parse_args(
        ["--quick", "--blocks", "4", "16", "--dtype", "int8", "--json", "--quiet", "--out", "/x"]
    )
    assert (args.quick, args.blocks, args.dtype, args.json) == (True, [4, 16], "int8", True)
    assert ("tpu_inference" in sys.modules) == before
