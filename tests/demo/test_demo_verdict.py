"""A demo that did not do its job never reads as a pass, and the command line says why
at once.

Before: `demo --tier redis://...` with no server behind it printed PASS and exited 0
(the tier fails open, and the verdict looked at the logits alone); a role process of
`--two-process` that exited non-zero after printing a pass, hung, or hit part of the
prefix could pass; a bad `--tier`, size or tier directory was reported only after
importing jax; `--two-process` wrote nothing to a log until the end, naming the last
tier only.
"""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import threading

import pytest

from jax_kvoffload.cli import main
from jax_kvoffload.demo import (
    DemoModelConfig,
    ScenarioConfig,
    StreamProgress,
    _two_process,
    format_summary,
    run_scenario,
)
from jax_kvoffload.demo._verdict import reader_verdict, tier_verdict
from tests.tiers._helpers import free_port

from .test_demo import SMALL, SMALL_FLAGS


class Mute:
    """A server that accepts every connection and closes it at once: reachable, so the
    command line's check passes, and useless, so the tier takes no store."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()

    def stop(self) -> None:
        self.sock.close()
        self.thread.join(5)


@pytest.fixture
def mute():
    server = Mute()
    yield server
    server.stop()


def small(**kw) -> ScenarioConfig:
    return ScenarioConfig(
        model=DemoModelConfig(**SMALL), block_size=8, prompt_blocks=4, suffix_tokens=12,
        decode_tokens=2, **kw,
    )  # fmt: skip


# ---- one process: a tier that took nothing fails the demo, naming it and why ----------


def test_a_tier_that_took_no_store_fails_the_demo_and_says_why(mute, capsys):
    code = main(["demo", "--quiet", "--tier", mute.url, *SMALL_FLAGS])
    out = capsys.readouterr().out
    assert code == 1, out
    overall = next(ln for ln in out.splitlines() if ln.strip().startswith("overall"))
    assert f"FAIL: tier {mute.url}: 0 of the 2 chunks offered reached it" in overall, overall
    assert "logits check" in out and "PASS" in out  # the logits did check out: only the tier


def test_the_json_says_which_tier_failed_and_why(tmp_path):
    url = f"redis://127.0.0.1:{free_port()}"  # nothing listens: run_scenario has no pre-check
    s = run_scenario(small(tiers=(f"disk:{tmp_path / 'tier'}", url)))
    disk, redis = s["tiers"]
    assert s["check"]["passed"] and not s["passed"]
    assert disk["check"] == {"passed": True, "why": None}
    assert not redis["check"]["passed"]
    why = redis["check"]["why"]
    assert why.startswith(f"tier {url}: 0 of the 2 chunks offered reached it"), why
    assert "refused" in why or "warnings" in why, why  # the tier's own warning, if not said before
    assert "FAIL: tier redis://" in format_summary(s)


def test_a_demo_with_working_tiers_passes(tmp_path):
    s = run_scenario(small(tiers=(f"disk:{tmp_path / 'a'}", f"disk:{tmp_path / 'b'}")))
    assert s["passed"] and all(t["check"]["passed"] for t in s["tiers"])
    overall = next(ln for ln in format_summary(s).splitlines() if ln.strip().startswith("overall"))
    assert overall.endswith("PASS (every tier took A's chunks)"), overall


@pytest.mark.parametrize(
    ("stats", "passed"),
    [
        (dict(cascaded=2, cascade_failed=0, cascade_dropped=0), True),
        (dict(cascaded=4, cascade_failed=0, cascade_dropped=0), True),  # and the warm-up's
        (dict(cascaded=1, cascade_failed=0, cascade_dropped=0), False),  # part of A's
        (dict(cascaded=4, cascade_failed=1, cascade_dropped=0), False),  # one failed
        (dict(cascaded=4, cascade_failed=0, cascade_dropped=1), False),  # one dropped
        (dict(cascaded=0, cascade_failed=0, cascade_dropped=0), False),  # never offered
    ],
)
def test_a_tier_passes_only_if_it_took_every_chunk_offered(stats, passed):
    verdict = tier_verdict("disk:/x", stats, 2, None)
    assert verdict["passed"] is passed
    assert (verdict["why"] is None) is passed
    if not passed:
        assert verdict["why"].startswith("tier disk:/x: ")


@pytest.mark.parametrize(
    ("hit", "promoted", "passed"),
    [(4, 2, True), (2, 1, False), (4, 0, False), (0, 0, False)],
)
def test_the_reader_passes_only_if_the_tier_served_the_whole_prefix(hit, promoted, passed):
    stats = dict(promoted=promoted, promotion_failed=0, promotion_no_room=0)
    verdict = reader_verdict("disk:/x", stats, hit, 4, 2)
    assert verdict["passed"] is passed and (verdict["why"] is None) is passed


# ---- two processes: a role's process is believed only if it exited 0 ------------------


def fake_role(monkeypatch, script: str) -> None:
    monkeypatch.setattr(_two_process, "role_argv", lambda *a, **k: [sys.executable, "-c", script])


def test_a_role_that_exits_non_zero_after_printing_a_pass_fails(monkeypatch):
    fake_role(monkeypatch, "print('{\"passed\": true}'); raise SystemExit(3)")
    out = _two_process._run_role(small(tiers=("disk:/x",)), "writer", "disk:/x", None)
    assert out["passed"] is False and out["error"] == "exit 3 after reporting a pass"


def test_a_role_that_hangs_is_killed_and_fails(monkeypatch):
    monkeypatch.setattr(_two_process, "ROLE_TIMEOUT_S", 1)
    fake_role(monkeypatch, "import time; time.sleep(60)")
    out = _two_process._run_role(small(tiers=("disk:/x",)), "reader", "disk:/x", None)
    assert out == {"role": "reader", "passed": False, "error": "killed after 1 s"}


def test_a_role_without_a_report_fails_with_its_last_stderr_line(monkeypatch):
    fake_role(monkeypatch, "import sys; sys.stderr.write('one\\ntwo: the reason\\n'); exit(1)")
    lines = []
    out = _two_process._run_role(small(tiers=("disk:/x",)), "writer", "disk:/x", lines.append)
    assert out["error"] == "exit 1: two: the reason"
    assert lines == ["    [writer] one", "    [writer] two: the reason"]  # relayed as they came


def test_two_process_progress_names_every_tier_and_role_in_a_log(monkeypatch):
    # Not a terminal: a line as each role starts and one, timed, as it ends.
    calls = []

    def run_role(cfg, role, tier, relay):
        calls.append((role, tier))
        relay(f"    [{role}] working on {tier}")
        return {"role": role, "passed": True, "backend": "cpu"}

    monkeypatch.setattr(_two_process, "_run_role", run_role)
    log = io.StringIO()
    progress = StreamProgress(log)
    tiers = ("disk:/a", "redis://127.0.0.1:1")
    summary = _two_process.run_two_process(small(tiers=tiers), progress, progress.line)
    assert summary["passed"] and summary["backend"] == "cpu"
    assert calls == [(r, t) for t in tiers for r in ("writer", "reader")]
    lines = log.getvalue().splitlines()
    expected = []
    for t in tiers:
        for role in ("writer", "reader"):
            expected += [f"  {role} {t}: started", f"    [{role}] working on {t}"]
            expected += [f"  {role} {t}: done (1 step)"]
    assert lines == expected


def test_progress_lines_in_a_log_carry_the_step_s_time(monkeypatch):
    clock = iter([0.0, 0.0, 12.34, 20.0, 20.05])
    monkeypatch.setattr("jax_kvoffload.demo._report.time.perf_counter", lambda: next(clock))
    log = io.StringIO()
    progress = StreamProgress(log)
    progress("writer disk:/a", 0, 1)
    progress("prefill A", 1, 2)  # began at 0.0
    progress("prefill A", 2, 2)
    progress("writer disk:/a", 1, 1)
    progress("quick", 1, 1)
    assert log.getvalue().splitlines() == [
        "  writer disk:/a: started",
        "  prefill A: done (2 steps, 12.3 s)",
        "  writer disk:/a: done (1 step, 20.0 s)",
        "  quick: done (1 step)",  # under 0.1 s: no time
    ]


# ---- the command line checks its arguments before importing jax -----------------------


def bad_arguments(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    return [
        (["--tier", "nope"], "must be disk:PATH"),
        (["--tier", "redis://127.0.0.1:0"], "port must be an int"),
        (["--tier", f"redis://127.0.0.1:{free_port()}"], "cannot connect to 127.0.0.1:"),
        (["--tier", f"disk:{shared}"], "chmod 700"),
        (["--tier", f"disk:{a_file}/tier"], "cannot create or open the tier directory"),
        (["--tier", f"disk:{a_file}"], "not a directory"),
        (["--two-process"], "--two-process needs at least one --tier"),
        (["--layers", "0"], "num_layers=0 must be a positive int"),
        (["--block-size", "0"], "block_size=0 must be a positive int"),
        (["--prompt-blocks", "1", "--blocks-per-chunk", "2"], "use prompt_blocks >= 2"),
    ]


PROBE = """
import json, sys
from jax_kvoffload.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    results.append(main(["demo", "--quiet", *argv]))
print(json.dumps({"codes": results, "jax": "jax" in sys.modules, "flax": "flax" in sys.modules}))
"""


def test_bad_arguments_are_reported_before_jax_is_imported(tmp_path):
    cases = bad_arguments(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps([argv for argv, _ in cases])],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["codes"] == [2] * len(cases)
    errors = done.stderr.splitlines()
    assert len(errors) == len(cases), errors
    for (argv, message), line in zip(cases, errors, strict=True):
        assert line.startswith("error: ") and message in line, (argv, line)
    assert (got["jax"], got["flax"]) == (False, False)


def test_a_warning_about_one_tier_is_not_blamed_on_another_whose_name_it_contains():
    # Before: `about()` matched substrings, so with --tier disk:/tmp/a and disk:/tmp/ab
    # the failure of /tmp/ab was given as /tmp/a's cause (and port 63790's as 6379's).
    from jax_kvoffload.demo._verdict import TierLog

    log = TierLog()
    log.messages += ["disk tier /tmp/ab: cannot write: No space left on device",
                     "redis tier 127.0.0.1:63790: connection refused"]  # fmt: skip
    assert log.about("disk:/tmp/a") is None
    assert log.about("redis://127.0.0.1:6379") is None
    assert "No space" in log.about("disk:/tmp/ab")
    log.messages.append("disk tier /tmp/a: bad entry /tmp/a/00/x.kv removed")
    assert "bad entry" in log.about("disk:/tmp/a")
