"""benchmarks/tiers.py --mooncake: its arguments are checked before anything runs, and a
small run on a private store reports the tier and Mooncake's own calls, each way, with
their ratio and target (docs/tiers.md, "Performance")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ._helpers import child_env
from ._mooncake import NO_MOONCAKE
from .test_tiers_benchmark_args import SCRIPT, load

REFUSED = [
    (["--mooncake", "--mooncake-master", "h:1"], "give both"),
    (["--mooncake-master", "h:1", "--mooncake-metadata", "http://h:2/m"], "add --mooncake"),
]


@pytest.mark.parametrize(("argv", "message"), REFUSED, ids=lambda v: str(v))
def test_nonsense_is_refused_with_the_rule(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        load().parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(NO_MOONCAKE is not None, reason=str(NO_MOONCAKE))
def test_a_small_run_reports_both_ways_against_mooncakes_own_calls(tmp_path):
    argv = ["--quick", "--no-disk", "--no-redis", "--mooncake", "--values", "16",
            "--value-kib", "256", "--repeats", "1", "--json", "--out", str(tmp_path)]  # fmt: skip
    out = subprocess.run([sys.executable, str(SCRIPT), *argv], env=child_env(),
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    doc = json.loads(out.stdout)
    rows = [r for r in doc["rows"] if r["tier"] == "mooncake"]
    assert [r["op"] for r in rows] == ["store", "load"]
    for r in rows:
        assert r["kind"] == "tier" and r["bytes"] == 16 * 256 * 1024 and r["target"] == 0.8
        assert r["ratio"] == pytest.approx(r["GBps"] / r["baseline_GBps"])
        assert "Mooncake batch_" in r["baseline"]
    assert (tmp_path / "tiers.csv").exists()
