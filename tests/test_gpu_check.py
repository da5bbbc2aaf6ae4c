"""benchmarks/gpu_check.sh, so that the first GPU minute is not spent on a typo: its dry
run on CPU runs every step end to end and ends with the P1-P4 table of both paths
(slow: about 2.5 min on the 2-core CI machine); the table's verdicts on a GPU."""

from __future__ import annotations

import csv
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import _gpu_table  # noqa: E402


@pytest.mark.slow
def test_the_dry_run_runs_every_step_and_ends_with_the_table(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu-dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    steps = (tmp_path / "steps.txt").read_text().splitlines()
    names = [line.split()[0] for line in steps]
    assert names == ["env", "copy_counts", "gpu_tests", "kernels", "gpu_paths", "pools"]
    assert all(line.split()[1] == "ok" for line in steps), steps
    table = (tmp_path / "table.txt").read_text()
    for check, path in [
        ("P1", "JAX kernels"),
        ("P1", "vLLM worker path"),
        *[(p, "JAX engine (PinnedRowPool)") for p in ("P2", "P3", "P4")],
        *[(p, "vLLM worker path") for p in ("P2", "P3", "P4")],
    ]:
        assert any(
            line.startswith(check) and path in line and "dry run (CPU)" in line
            for line in table.splitlines()
        ), (check, path, table)
    assert "copy_counts" in run.stdout and "== P1-P4 (cpu) ==" in run.stdout


def test_an_unknown_argument_is_refused_before_anything_runs(tmp_path):
    run = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--quik"],
        env={**os.environ, "OUT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "unknown argument --quik" in run.stderr
    assert not (tmp_path / "steps.txt").exists()


def write(path, rows):
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def test_the_table_judges_each_row_by_its_target_on_a_gpu(tmp_path):
    kernel = {"backend": "triton", "layers": 8, "page_kib": 16, "blocks": 256}
    write(
        tmp_path / "kernels.csv",
        [
            {**kernel, "gather_vs_copy": 0.9, "scatter_vs_copy": 0.95},
            {**kernel, "page_kib": 64, "gather_vs_copy": 0.8, "scatter_vs_copy": 0.99},
            {**kernel, "blocks": 16, "gather_vs_copy": 0.1, "scatter_vs_copy": 0.1},  # small
        ],
    )
    base = {"path": "vLLM worker path", "case": "c", "job_s": 1, "reference_s": 1}
    write(
        tmp_path / "gpu_paths.csv",
        [
            {**base, "check": "P2", "what": "store", "ratio": 0.95, "target": 0.9},
            {**base, "check": "P4", "what": "store", "ratio": 9.0, "target": 10.0},
        ],
    )
    lines = _gpu_table.table(tmp_path, "gpu").splitlines()
    gather = next(line for line in lines if "gather" in line)
    assert "0.80x" in gather and "MISSES" in gather  # the worst row of the card's sizes
    scatter = next(line for line in lines if "scatter" in line)
    assert "0.95x" in scatter and "meets" in scatter
    assert "meets" in next(line for line in lines if line.startswith("P2"))
    assert "MISSES" in next(line for line in lines if line.startswith("P4"))
    (tmp_path / "kernels.csv").unlink()
    assert "no kernels.csv" in _gpu_table.table(tmp_path, "gpu")
    assert "MISSES" not in _gpu_table.table(tmp_path, "cpu")
