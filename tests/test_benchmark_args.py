"""Each benchmark script refuses nonsense arguments with a clear error, before running.

Only the argument parsers run here (no benchmark): `parse_args` must exit with status 2
and name the argument and the rule; sensible arguments must parse."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_args_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


REFUSED = [
    ("offload", ["--repeats", "0"], "--repeats: must be an integer >= 1, got 0"),
    ("offload", ["--blocks", "-5"], "--blocks: must be an integer >= 1, got -5"),
    ("offload", ["--layers", "two"], "--layers: must be an integer >= 1, got 'two'"),
    ("offload", ["--backend", "cuda"], "--backend: invalid choice: 'cuda'"),
    ("offload", ["--quick", "extra"], "unrecognized arguments: extra"),
    ("canonical", ["--tp", "3"], "--tp 3: must divide the 16 KV heads"),
    ("canonical", ["--blocks", "20"], "--blocks 20: must be a multiple of 16; use 32"),
    ("canonical", ["--blocks", "0"], "--blocks: must be an integer >= 16, got 0"),
    ("canonical", ["--forms", "nhd"], "--forms: invalid choice: 'nhd'"),
    ("canonical", ["--repeats", "-1"], "--repeats: must be an integer >= 1, got -1"),
    ("mesh", ["--devices", "0"], "--devices: must be an integer >= 1, got 0"),
    ("mesh", ["--devices", "1", "3"], "--devices 3: the 16 KV heads"),
    ("mesh", ["--quick", "--heads", "6", "--devices", "4"], "--devices 4: the 6 KV heads"),
    ("mesh", ["--blocks", "100"], "--blocks 100: must be a multiple of 16; use 112"),
    ("kernels", ["--blocks", "0"], "--blocks: must be an integer >= 1, got 0"),
    ("kernels", ["--page-kib", "-4"], "--page-kib: must be an integer >= 1, got -4"),
    ("kernels", ["--max-gib", "0"], "--max-gib: must be a finite number > 0, got 0"),
    ("kernels", ["--max-gib", "nan"], "--max-gib: must be a finite number > 0, got nan"),
    ("kernels", ["--backends", "cuda"], "--backends: invalid choice: 'cuda'"),
    ("kernels", ["--repeats", "1.5"], "--repeats: must be an integer >= 1, got '1.5'"),
    ("kernels_rpa", ["--heads", "0"], "--heads: must be an integer >= 1, got 0"),
    ("kernels_rpa", ["--dtypes", "fp64"], "--dtypes: invalid choice: 'fp64'"),
    ("pools", ["--chunk-blocks", "0"], "--chunk-blocks: must be an integer >= 1, got 0"),
    ("pools", ["--blocks", "x"], "--blocks: must be an integer >= 1, got 'x'"),
    ("manager", ["--requests", "-5"], "--requests: must be an integer >= 1, got -5"),
    ("manager", ["--chunks", "0"], "--chunks: must be an integer >= 1, got 0"),
    ("manager", ["--zipf", "nan"], "--zipf: must be a finite number > 0, got nan"),
    ("manager", ["--quick", "--full"], "not allowed with argument --quick"),
    ("tiers", ["--chunks", "0"], "--chunks: must be an integer >= 1, got 0"),
    ("tiers", ["--no-redis", "--clients"], "--clients: belongs to the Redis part"),
    ("gpu_paths", ["--repeats", "0"], "--repeats: must be an integer >= 1, got 0"),
    ("gpu_paths", ["--quick", "--cpu-dry-run"], "not allowed with argument --quick"),
    ("gpu_paths", ["--paths", "cuda"], "--paths: invalid choice: 'cuda'"),
]


@pytest.mark.parametrize(("name", "argv", "message"), REFUSED, ids=lambda v: str(v))
def test_nonsense_is_refused_with_the_rule(capsys, name, argv, message):
    with pytest.raises(SystemExit) as exc:
        load(name).parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err


ACCEPTED = [
    ("pools", ["--quick", "--blocks", "64", "--chunk-blocks", "4", "--json"]),
    ("offload", ["--quick", "--layers", "8", "--blocks", "64", "256", "--json"]),
    ("canonical", ["--quick", "--tp", "1", "2", "--forms", "split-hnd", "--blocks", "32"]),
    ("mesh", ["--quick", "--devices", "1", "2", "--json", "--quiet"]),
    ("kernels", ["--quick", "--backends", "xla", "--max-gib", "0.5", "--out", "/tmp/x"]),
    ("kernels_rpa", ["--quick", "--backends", "xla", "--dtypes", "fp8", "--json"]),
    ("manager", ["--quick", "--requests", "300", "--policies", "arc", "--json", "--quiet"]),
    ("tiers", ["--quick", "--no-disk", "--clients", "--json", "--quiet"]),
    ("gpu_paths", ["--quick", "--paths", "torch", "--repeats", "3", "--out", "/tmp/x"]),
]


@pytest.mark.parametrize(("name", "argv"), ACCEPTED, ids=lambda v: str(v))
def test_sensible_arguments_parse(name, argv):
    args = load(name).parse_args(argv)
    assert args.quick


def test_every_benchmark_script_of_ours_is_covered():
    """(tests/tiers/test_tiers_benchmark_args.py covers tiers in depth.)"""
    ours = {"offload", "canonical", "mesh", "kernels", "kernels_rpa", "pools", "manager", "tiers"}
    ours |= {"gpu_paths"}
    assert ours <= {p.stem for p in BENCHMARKS.glob("*.py")}
    assert {n for n, *_ in REFUSED} == ours


def test_every_benchmark_offers_json_quiet_and_out():
    """Each `jax-kvoffload bench NAME` script accepts the shared output flags (tiers had
    no --json, no --quiet)."""
    from jax_kvoffload.cli import BENCHMARKS as NAMES

    for name in NAMES:
        args = load(name).parse_args(["--json", "--quiet", "--out", "/tmp/x"])
        assert (args.json, args.quiet, str(args.out)) == (True, True, "/tmp/x"), name


# -- the shared output (benchmarks/_report.py), without running a benchmark -------------


def test_tables_are_aligned_and_say_their_units():
    report = load("_report")
    Col = report.Col
    rows = [
        {"form": "split-nhd", "tp": 2, "t": 0.0123, "bw": 3.14159, "r": 1.5, "share": 0.042},
        {"form": "x", "tp": 16, "t": 1.5, "bw": float("nan"), "r": 0.25, "share": -0.5},
    ]
    cols = [
        Col("form", "layout", text=True),
        Col("tp", "TP"),
        Col("t", "job", "ms", 1),
        Col("bw", "rate", "GiB/s"),
        Col("r", "ratio", "x"),
        Col("share", "extra", "%"),
    ]
    lines = report.table(rows, cols).splitlines()
    assert lines[0].split() == ["layout", "TP", "job", "rate", "ratio", "extra"]
    assert lines[1].split() == ["ms", "GiB/s"]
    assert lines[3].split() == ["split-nhd", "2", "12.3", "3.14", "1.50×", "+4.2%"]
    assert lines[4].split() == ["x", "16", "1500.0", "-", "0.25×", "-50.0%"]
    # Columns line up: numbers are right-aligned under their header, names left-aligned.
    assert len({len(lines[i]) for i in (0, 2, 3, 4)}) == 1
    assert lines[0].index("TP") + 2 == lines[4].index("16") + 2
    assert lines[3].index("split-nhd") == lines[4].index("x ") == 0


def test_json_output_is_one_document_on_stdout(capsys):
    import argparse
    import json

    report = load("_report")
    rows = [{"devices": 1, "store": 0.01}]
    args = argparse.Namespace(json=True)
    report.emit("mesh", args, [("", rows, [report.Col("devices", "devices")])], rows, note="n")
    doc = json.loads(capsys.readouterr().out)
    assert doc["benchmark"] == "mesh" and doc["rows"] == rows and doc["note"] == "n"


def test_manager_table_without_vllm_prints_dashes(capsys):
    """Without vLLM (the README's install) there is no "x vLLM" ratio: the table shows "-"
    (formatting None raised TypeError, so `bench manager` and tests/test_cli.py failed in a
    venv without vLLM), under the shared table's headers and units."""
    manager = load("manager")
    row = {
        "policy": "lru",
        "impl": "HostStore",
        "api": "own",
        "calls": 7739,
        "trace_s": 0.0336,
        "s_per_call": 4.341e-6,
        "speedup": None,
        "lookups_per_s": 6.8e6,
        "lookup_speedup": None,
    }
    manager.print_table([row, {**row, "policy": "arc", "calls": 12}])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["ms", "µs", "M/s"]
    assert lines[3].split() == [
        "lru",
        "HostStore",
        "own",
        "7,739",
        "33.6",
        "4.341",
        "-",
        "6.80",
        "-",
    ]
    assert len({len(line) for line in lines[2:]}) == 1  # aligned
