"""tpu-inference 0.32.0's offload connector, driven on a CPU mesh: the baseline ours matches.

`harness.py` runs every scenario for one connector in a subprocess (the CPU device
count is fixed when jax starts, and importing tpu-inference rewrites `XLA_FLAGS` and
other variables of its process: `_env.py`); each scenario is one test here. The
connectors under test are `CONNECTORS`: tpu-inference's own `TPUOffloadConnector` with
its `LocalCPUBackend`, and ours (`jax_kvoffload.bridge.tpu_inference`, slow: a harness
run takes a minute or two on 2 cores) with the same scenarios. Ours also runs the tier
scenarios, each in a fresh process: one engine saves, another process's engine is
served the prefix from our disk tier, and from Redis.

Where a connector is known to fail a scenario on this machine, `KNOWN` says why and
what the failure must look like: the test is then an expected failure, and a pass
fails it (the entry is stale). Skipped, saying why, without tpu-inference or vLLM
(`.ci/run` installs both; docs/tpu_inference.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests.tpu_inference.harness import SCENARIOS, THEIRS

OURS = "jax_kvoffload.bridge.tpu_inference:TPUOffloadConnector"

ROOT = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 1200


def _missing() -> str | None:
    for module, what in (("vllm", "vLLM 0.33.0"), ("tpu_inference", "tpu-inference 0.32.0")):
        if importlib.util.find_spec(module) is None:  # looks only; imports nothing
            return (
                f"{what} is not installed (.ci/run installs it with --no-deps and "
                ".ci/tpu-inference-requirements.txt; see docs/tpu_inference.md)"
            )
    return None


pytestmark = [pytest.mark.vllm, pytest.mark.skipif(_missing() is not None, reason=str(_missing()))]

CONNECTORS = [THEIRS, pytest.param(OURS, marks=pytest.mark.slow)]

_FLOAT_BITS = "loaded blocks \\(layer, block\\) without the saved bits"
_CPU_BITS = (
    "their pure-JAX gather and scatter run through XLA:CPU, which does not keep every float "
    "bit pattern: bf16 NaN payloads change on any mesh (XLA:CPU computes bf16 in f32), and "
    "with the blocks sharded over attn_dp the partitioned gather also turns -0.0 into +0.0 "
    "and flushes subnormals (f32, fp8); integers keep their bits (docs/tpu_inference.md)"
)
KNOWN: dict[str, dict[str, tuple[str, str]]] = {
    THEIRS: {
        "roundtrip/model/bfloat16/values": (
            "Only interpret mode is supported on CPU backend",
            "on a mesh without attn_dp their load is the Pallas TPU DMA kernel "
            "(tpu_inference/distributed/kv_transfer.py), which has no CPU lowering",
        ),
        **{
            f"roundtrip/attn_dp/{dtype}/bits": (_FLOAT_BITS, _CPU_BITS)
            for dtype in ("bfloat16", "float8_e4m3fn", "float32")
        },
    },
    OURS: {},  # every scenario, every bit pattern, the mesh without attn_dp too
}
# Prefix blocks a restarted engine is served (engine/restart, without tiers): host memory
# dies with the engine, theirs and ours; ours serves it from a tier (tier/* below).
RESTART_HITS = {THEIRS: 0, OURS: 0}
# BlockStored hashes after a 3-block prompt was saved with KV events on (engine/events):
# their connector yields none (the base class's take_events), ours one per block.
STORED_EVENTS = {THEIRS: 0, OURS: 3}


def _run_harness(
    connector: str, out: pathlib.Path, extra: dict | None = None, only: list[str] | None = None
) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    # ROOT first: tpu-inference's wheel installs a top-level `tests` package of its own.
    command = [sys.executable, "-m", "tests.tpu_inference.harness", "--out", str(out)]
    command += ["--connector", connector]
    if extra is not None:
        command += ["--extra-config", json.dumps(extra)]
    if only:
        command += ["--only", *only]
    try:
        proc = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the harness ran past {TIMEOUT_S} s for {connector}: {exc.stderr!r:.2000}")
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"the harness failed for {connector} (exit {proc.returncode}):\n{proc.stderr}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    runs: dict[str, dict] = {}

    def get(connector: str) -> dict:
        if connector not in runs:
            out = tmp_path_factory.mktemp("tpu_inference") / "results.json"
            runs[connector] = _run_harness(connector, out)
        return runs[connector]

    return get


def _name(connector: str) -> str:
    return "ours" if connector == OURS else connector.rsplit(":", 1)[-1]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("connector", CONNECTORS, ids=_name)
def test_scenario(results, connector, scenario):
    result = results(connector)[scenario]
    known = KNOWN.get(connector, {}).get(scenario)
    if known is not None:
        pattern, reason = known
        if result["ok"]:
            pytest.fail(f"{scenario} passes for {connector} now; drop it from KNOWN ({reason})")
        assert re.search(pattern, result["error"]), result["error"]
        pytest.xfail(reason)
    assert result["ok"], result["error"]
    if "skipped" in result["facts"]:
        pytest.skip(result["facts"]["skipped"])
    if scenario == "engine/restart":
        assert result["facts"]["hits_after_restart"] == RESTART_HITS[connector], result["facts"]
    if scenario == "engine/events":  # ours: the store's events, as vLLM's KV events
        facts = result["facts"]
        assert facts["stored"] == STORED_EVENTS[connector], facts
        assert facts["stored_hashes_are_the_prompts"] or not facts["stored"], facts


def test_environment_is_what_the_docs_say(results):
    """The harness stood in their runner module (its import chain needs tokamax, which
    needs Python >= 3.12) and, with torchax installed, the two aten overloads torch 2.13
    removed."""
    env = results(THEIRS)["_env"]
    if sys.version_info < (3, 12):
        assert env["runner"] == "stand-in", env
    if importlib.util.find_spec("torchax") is not None:
        removed = {"aten::prod.dim_Dimname", "aten::index_copy.dimname"}
        assert set(env["removed_overloads"]) <= removed, env


def _serve_from_tier(tmp_path: pathlib.Path, tier: dict) -> dict:
    """One process saves the prompt into `tier`; a fresh one is served it."""
    extra = {"secondary_tiers": [tier]}
    saved = _run_harness(OURS, tmp_path / "save.json", extra, ["tier/save"])["tier/save"]
    assert saved["ok"], saved["error"]
    served = _run_harness(OURS, tmp_path / "serve.json", extra, ["tier/serve"])["tier/serve"]
    assert served["ok"], served["error"]
    return served["facts"]["after"]


@pytest.mark.slow
def test_a_fresh_process_is_served_from_our_disk_tier(tmp_path):
    directory = tmp_path / "tier"
    facts = _serve_from_tier(
        tmp_path, {"type": "disk", "path": str(directory), "capacity_bytes": "1GiB"}
    )
    assert facts["matched_tokens"] == 3 * 16 and facts["loaded_chunks"] == 3, facts
    assert any(directory.rglob("*")), "the disk tier holds no entry"


@pytest.mark.slow
def test_a_second_process_is_served_from_redis(tmp_path):
    from tests.tiers._helpers import NO_REDIS, REDIS_SERVER, RedisServer

    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS)
    server = RedisServer()
    try:
        facts = _serve_from_tier(tmp_path, {"type": "redis", "url": server.url})
        assert facts["matched_tokens"] == 3 * 16 and facts["loaded_chunks"] == 3, facts
    finally:
        server.stop()
