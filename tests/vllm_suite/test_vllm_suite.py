"""vLLM 0.33.0's own offloading tests, run against our manager, policies, spec and config
adapter (substituted by the plugin in vllm_substitution.py; vLLM's files are untouched).

They run in one subprocess (vLLM's tests import their own top-level ``tests`` package,
which would clash with ours, and need their own pytest settings). Each selected file is
one test here, which fails with the unexpected outcomes of that file: a failure, an
error, or a strict XPASS of a listed difference (its fix landed: delete the entry from
expected_differences.toml). Skipped without vLLM 0.33.0, torch, einops, or the test
sources (``python tests/vllm_suite/fetch_vllm_tests.py`` puts them in ``.vllm-tests/``;
``JAX_KVOFFLOAD_VLLM_TESTS`` may point elsewhere).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

from . import vllm_suite_manifest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SOURCE = pathlib.Path(
    os.environ.get("JAX_KVOFFLOAD_VLLM_TESTS", ROOT / ".vllm-tests" / "0.33.0")
).resolve()
MANIFEST = vllm_suite_manifest.load()
TIMEOUT_S = 600
# Unexpected outcomes re-run with tracebacks (the main run leaves them out: formatting
# tracebacks of vLLM's MagicMock-heavy tests costs more than running them).
MAX_DETAILED = 20

pytestmark = pytest.mark.vllm


def _unavailable() -> str | None:
    """Why the suite cannot run here, or None."""
    for module in ("torch", "vllm", "einops"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (vLLM's offloading tests need it)"
    version = importlib.metadata.version("vllm")
    if version != "0.33.0":
        return f"vLLM {version} is installed; these are vLLM 0.33.0's tests"
    if not (SOURCE / "tests" / "v1" / "kv_offload").is_dir():
        return (
            f"vLLM 0.33.0's test sources are not in {SOURCE}; fetch them with "
            "`python tests/vllm_suite/fetch_vllm_tests.py`"
        )
    return None


def _run(args: list[str], report: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["JAX_KVOFFLOAD_VLLM_SUITE_HF_HOME"] = str(report.parent / "hf")
    env.pop("PYTEST_ADDOPTS", None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # The plugin, then this checkout (after the working directory, vLLM's sources, so
    # that `tests` is vLLM's package there).
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE), str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-c",
        str(HERE / "vllm_pytest.ini"),
        "--rootdir",
        str(SOURCE),
        "-p",
        "vllm_substitution",
        "-q",
        f"--vllm-suite-report={report}",
        *args,
    ]
    try:
        return subprocess.run(
            command, cwd=SOURCE, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        pytest.fail(f"vLLM's tests did not finish in {TIMEOUT_S} s:\n{out}", pytrace=False)


def _results(proc: subprocess.CompletedProcess, report: pathlib.Path) -> dict[str, dict]:
    if proc.returncode not in (0, 1) or not report.is_file():
        # 2-5: interrupted, internal error, usage error (e.g. a stale manifest entry),
        # nothing collected.
        pytest.fail(
            f"vLLM's test run ended with exit status {proc.returncode}:\n"
            f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}",
            pytrace=False,
        )
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def suite_results() -> dict[str, dict]:
    reason = _unavailable()
    if reason is not None:
        pytest.skip(reason)
    with tempfile.TemporaryDirectory(prefix="jax-kvoffload-vllm-suite-") as tmp:
        report = pathlib.Path(tmp) / "report.json"
        results = _results(_run(["--tb=no", *MANIFEST.files], report), report)
        bad = [k for k, v in results.items() if v["outcome"] in ("failed", "error")]
        if bad:
            detailed = pathlib.Path(tmp) / "detailed.json"
            proc = _run(["--tb=short", *bad[:MAX_DETAILED]], detailed)
            if detailed.is_file():
                for nodeid, result in json.loads(detailed.read_text()).items():
                    if result["outcome"] in ("failed", "error"):
                        results[nodeid] = result
            else:
                results["(re-run with tracebacks)"] = {"outcome": "error", "text": proc.stdout}
    return results


def _in_selection(nodeid: str, selection: str) -> bool:
    return nodeid == selection or nodeid.startswith(selection + "::")


@pytest.mark.slow  # vLLM's own suite in a subprocess: ~48 s on 2 idle cores
@pytest.mark.parametrize(
    "selection", MANIFEST.files, ids=[s.rsplit("/", 1)[-1] for s in MANIFEST.files]
)
def test_vllm_offloading_tests_pass_against_ours(suite_results, selection):
    results = {k: v for k, v in suite_results.items() if _in_selection(k, selection)}
    assert results, f"no test of {selection} ran (renamed in vLLM's sources?)"
    bad = {k: v for k, v in results.items() if v["outcome"] in ("failed", "error")}
    if bad:
        lines = [
            f"{len(bad)} of {len(results)} tests of vLLM's {selection} failed against ours "
            "(unexpected: not listed in tests/vllm_suite/expected_differences.toml, "
            "listed but failing differently, or listed and now passing):"
        ]
        for nodeid, result in sorted(bad.items()):
            lines.append(f"\n{result['outcome'].upper()} {nodeid}\n{result['text'].strip()}")
        pytest.fail("\n".join(lines), pytrace=False)


def _covers(decided: str, relative: str) -> bool:
    # A folder entry ends with "/" and covers everything below it.
    return relative == decided or (decided.endswith("/") and relative.startswith(decided))


def test_every_offloading_test_file_is_run_or_excluded():
    """A test file vLLM adds (or one left out by mistake) must be decided on."""
    if not (SOURCE / "tests").is_dir():
        pytest.skip(f"vLLM 0.33.0's test sources are not in {SOURCE}")
    decided = [s.split("::")[0] for s in MANIFEST.files] + list(MANIFEST.excluded)
    undecided = []
    for folder in ("tests/v1/kv_offload", "tests/v1/kv_connector/unit/offloading_connector"):
        for path in sorted((SOURCE / folder).rglob("test_*.py")):
            relative = path.relative_to(SOURCE).as_posix()
            if not any(_covers(d, relative) for d in decided):
                undecided.append(relative)
    assert not undecided, f"run them (files) or exclude them with a reason: {undecided}"
