"""`demo --two-process`, the parent: per tier a writer process, then a reader process.

The parent imports neither jax nor the model (the roles do, `_tiered.py`): it starts
the first process at once. Each role's stderr (its progress and the library's warnings)
is relayed line by line as it comes, so a log shows what runs when its output is not a
terminal; each role is a progress step of its own, named with its tier.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from jax_kvoffload.demo._config import Progress, ScenarioConfig

__all__ = ["ROLE_TIMEOUT_S", "role_argv", "role_env", "run_two_process"]

ROLE_TIMEOUT_S = 600  # one role's process: importing jax, compiling and running the model


def role_argv(cfg: ScenarioConfig, role: str, tier: str, *, quiet: bool = True) -> list[str]:
    """The command line of one role's process (`python -m jax_kvoffload demo ...`)."""
    m = cfg.model
    argv = [
        sys.executable, "-m", "jax_kvoffload", "demo", "--role", role, "--tier", tier,
        "--json",
        "--layers", str(m.num_layers), "--heads", str(m.num_heads),
        "--kv-heads", str(m.num_kv_heads), "--head-dim", str(m.head_dim),
        "--ffn-dim", str(m.ffn_dim), "--vocab", str(m.vocab_size), "--seed", str(m.seed),
        "--block-size", str(cfg.block_size), "--prompt-blocks", str(cfg.prompt_blocks),
        "--suffix-tokens", str(cfg.suffix_tokens), "--decode-tokens", str(cfg.decode_tokens),
        "--blocks-per-chunk", str(cfg.blocks_per_chunk), "--kernel-backend", cfg.kernel_backend,
    ]  # fmt: skip
    if cfg.mesh_sizes is not None:
        argv += ["--mesh-sizes", ",".join(map(str, cfg.mesh_sizes))]
    if cfg.skip_load:  # the negative control reaches the reader
        argv.append("--skip-load")
    return argv + ([] if m.rope else ["--no-rope"]) + (["--quiet"] if quiet else [])


def role_env(cfg: ScenarioConfig, role: str) -> dict[str, str] | None:
    """The environment of one role's process: with `mesh_sizes`, as many host (CPU)
    devices as its mesh needs (XLA fixes the count when jax starts; on an accelerator
    the mesh takes the first devices of the platform and the flag is unused)."""
    if cfg.mesh_sizes is None:
        return None
    n = cfg.mesh_sizes[0 if role == "writer" else 1]
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    return env


def _run_role(
    cfg: ScenarioConfig, role: str, tier: str, relay: Callable[[str], None] | None
) -> dict:
    """One role's process: its JSON report, or `{"passed": False, "error": why}`."""
    proc = subprocess.Popen(
        role_argv(cfg, role, tier, quiet=relay is None),
        env=role_env(cfg, role),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None  # both piped
    err_pipe = proc.stderr
    tail: collections.deque[str] = collections.deque(maxlen=5)

    def read_stderr() -> None:
        for line in err_pipe:
            tail.append(line.rstrip("\n"))
            if relay is not None:
                relay(f"    [{role}] {line.rstrip()}")

    stderr = threading.Thread(target=read_stderr, name=f"demo-{role}-stderr", daemon=True)
    stderr.start()
    # A role that hangs is killed, its pipes then close and both reads end.
    killer = threading.Timer(ROLE_TIMEOUT_S, proc.kill)
    killer.start()
    try:
        stdout = proc.stdout.read()
        code = proc.wait()
        stderr.join()
    finally:
        killer.cancel()
        proc.stdout.close()
        proc.stderr.close()
    try:
        out = json.loads(stdout)
    except json.JSONDecodeError:
        if code == -9:
            why = f"killed after {ROLE_TIMEOUT_S} s"
        else:
            why = f"exit {code}: {tail[-1] if tail else 'no output'}"
        return {"role": role, "passed": False, "error": why}
    out["exit_code"] = code
    if code != 0 and out.get("passed"):
        out.update(passed=False, error=f"exit {code} after reporting a pass")
    return out


def run_two_process(
    cfg: ScenarioConfig,
    progress: Progress | None = None,
    relay: Callable[[str], None] | None = None,
) -> dict:
    """For each tier of `cfg.tiers`: a writer process, then a reader process.

    `progress(step, done, total)` sees one step per role ("writer disk:/x"), started
    then done; `relay(line)`, if given, each line the roles write on stderr.
    """
    report = progress or (lambda *_: None)
    wall = time.perf_counter()
    runs: list[dict[str, Any]] = []
    for tier in cfg.tiers:
        step = f"writer {tier}"
        report(step, 0, 1)
        writer = _run_role(cfg, "writer", tier, relay)
        report(step, 1, 1)
        reader = None
        if writer.get("passed"):
            step = f"reader {tier}"
            report(step, 0, 1)
            reader = _run_role(cfg, "reader", tier, relay)
            report(step, 1, 1)
        runs.append({"tier": tier, "writer": writer, "reader": reader})
    passed = all(r["writer"].get("passed") and (r["reader"] or {}).get("passed") for r in runs)
    backends = [r[role].get("backend") for r in runs for role in ("writer", "reader") if r[role]]
    return {
        "mode": "two-process",
        "backend": next((b for b in backends if b), "unknown"),
        "model": asdict(cfg.model),
        "scenario": {k: v for k, v in asdict(cfg).items() if k != "model"} | {"tiers": ()},
        "mesh_sizes": list(cfg.mesh_sizes) if cfg.mesh_sizes else None,
        "runs": runs,
        "passed": bool(runs) and passed,
        "wall_s": time.perf_counter() - wall,
    }
