"""The README's `python -m pytest` is the fast suite, and says what it leaves out.

Before: the `slow` marker existed but no test used it, so the README's command ran the
soaks, the whole-process demos and vLLM's own suite too (24 minutes on a busy 2-core
machine), and nothing said how long it takes. Now they are marked `slow`, a plain run
leaves them out and says so, `--slow` or `-m slow` brings them back, `.ci/run` runs
them after the fast suite, and the README gives the times.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A slow test whose module imports no jax (the store is pure Python): collected fast.
SLOW = "tests/store/test_state_machine.py"


def collect(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode in (0, 5), done.stdout + done.stderr  # 5: nothing collected
    return done.stdout


def test_a_plain_run_leaves_the_slow_tests_out_and_says_so():
    out = collect(SLOW)
    assert "test_store_machine" not in out and "test_machine_pinned_key_sequence" in out
    assert re.search(r"\d+ tests marked slow were left out: run them with --slow", out), out


def test_slow_tests_come_back_with_slow_with_m_slow_and_by_name():
    for args in (["--slow", SLOW], ["-m", "slow", SLOW], [f"{SLOW}::test_store_machine"]):
        out = collect(*args)
        assert "test_store_machine::runTest" in out, (args, out)
        assert "left out" not in out


def test_ci_runs_the_slow_tests_after_the_readme_command_and_the_readme_gives_times():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^python -m pytest\n+python -m pytest -m slow$", ci, re.M), ci
    readme = (ROOT / "README.md").read_text()
    assert "python -m pytest -m slow" in readme
    section = readme[readme.index("How long the tests take") :]
    assert re.search(r"`python -m pytest`.*\bmin", section), section[:600]
