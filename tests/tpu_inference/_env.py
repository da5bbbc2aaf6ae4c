"""The process environment tpu-inference 0.32.0 needs on a CPU machine (stdlib only).

Call `prepare(devices)` first thing in a process that will import tpu-inference (the
harness and the benchmark run in their own processes: the CPU device count must be set
before jax initialises, and importing tpu-inference rewrites `XLA_FLAGS`,
`LIBTPU_INIT_ARGS` and two vLLM variables in `os.environ`, tpu_inference/env_override.py).

What it sets, and why (read in the 0.32.0 sources):

- `TPU_NAME`, `TPU_WORKER_ID`, `TPU_ACCELERATOR_TYPE`: `import tpu_inference` logs TPU
  info through `tpu_info.get_node_name` / `get_node_worker_id` / `get_tpu_type`, which
  ask the cloud metadata server (`requests.get` without a timeout) for every one of
  the three that is unset (`TPU_NAME` also when empty). 0.32.0 reads no
  `TPU_SKIP_MDS_QUERY`.
- `JAX_PLATFORMS=cpu` (their `envs.JAX_PLATFORMS` accepts "", "tpu", "cpu", "proxy").
- `XLA_FLAGS=--xla_force_host_platform_device_count=N`: a CPU mesh of N devices.
- `TPU_OFFLOAD_SKIP_JAX_PRECOMPILE=1` unless set: registering a runner otherwise compiles
  every block bucket (`TPU_OFFLOAD_BLOCK_SIZE_BUCKETS`, default 1..64) twice.

Two compatibility steps, each applied only where needed:

- torch 2.13 removed the Dimname overloads `aten::prod.dim_Dimname` and
  `aten::index_copy.dimname`; torchax 0.0.13 (the newest) names them in its tables at
  import, and `tpu_inference.utils` (imported by their platform, kv-cache and kernel
  modules, not by the offload modules) imports torchax. Where torchax is installed and
  an overload is missing, a named placeholder takes its place (never called: they
  are dictionary keys and decomposition-list entries there).
- `tpu_inference.runner.tpu_runner` cannot be imported on Python 3.11 with torch 2.13
  (it needs tokamax, whose releases need Python >= 3.12, and torchax, qwix,
  compressed-tensors, numba). The offload connector imports it only for the
  `TPUModelRunner` type of `register_runner`; where the runner's dependencies are
  missing, a module holding a bare `TPUModelRunner` class stands in (their own offload
  tests replace the runner with a `MockTPUModelRunner` subclass likewise).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

# What tpu_inference/tpu_info.py asks the metadata server for when unset.
PROBED = {"TPU_NAME": "cpu-test", "TPU_WORKER_ID": "0", "TPU_ACCELERATOR_TYPE": "cpu"}
# The aten overloads torch 2.13 removed that torchax 0.0.13 names at import.
REMOVED_OVERLOADS = (("prod", "dim_Dimname"), ("index_copy", "dimname"))
# What tpu_inference/runner/tpu_runner.py's import chain needs beyond our CI venv.
RUNNER_NEEDS = ("torchax", "qwix", "tokamax", "compressed_tensors", "numba")
RUNNER_MODULE = "tpu_inference.runner.tpu_runner"


class _RemovedOverload:
    """Placeholder for an aten overload this torch no longer has (hashable, inert)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<removed overload {self.name}>"


def prepare(devices: int = 4) -> dict[str, object]:
    """Sets the environment and applies the compatibility steps; returns what it did.

    Must run before jax (or anything importing it) is imported in this process."""
    if "jax" in sys.modules:
        raise RuntimeError(
            "tests.tpu_inference._env.prepare() must run before jax is imported: the CPU "
            "device count is read when jax initialises"
        )
    for name, value in PROBED.items():
        if not os.environ.get(name):
            os.environ[name] = value
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    os.environ.setdefault("TPU_OFFLOAD_SKIP_JAX_PRECOMPILE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return {"removed_overloads": patch_torch_for_torchax(), "runner": stand_in_runner()}


def patch_torch_for_torchax() -> list[str]:
    """Placeholders for the overloads torchax names and torch lacks (none without torchax)."""
    if importlib.util.find_spec("torchax") is None:
        return []
    import torch

    patched = []
    for packet_name, overload in REMOVED_OVERLOADS:
        packet = getattr(torch.ops.aten, packet_name)
        if overload not in packet.overloads():
            setattr(packet, overload, _RemovedOverload(f"aten::{packet_name}.{overload}"))
            patched.append(f"aten::{packet_name}.{overload}")
    return patched


def runner_missing() -> list[str]:
    """The runner's dependencies that are not installed ([] where it can be imported)."""
    missing = [m for m in RUNNER_NEEDS if importlib.util.find_spec(m) is None]
    if sys.version_info < (3, 12) and "tokamax" not in missing:
        missing.append("tokamax (needs Python >= 3.12)")
    return missing


def stand_in_runner() -> str:
    """ "real" where their runner can be imported, else installs the stand-in: "stand-in"."""
    if not runner_missing():
        return "real"
    module = types.ModuleType(RUNNER_MODULE)
    module.__doc__ = (
        "Stand-in for tpu_inference.runner.tpu_runner (tests/tpu_inference/_env.py): the "
        "offload connector imports TPUModelRunner only as the type of register_runner."
    )

    class TPUModelRunner:
        """What the offload worker reads of a runner: `kv_caches` (list of jax.Array,
        reassigned by the worker after each donated gather/scatter), `mesh`, `devices`
        and `get_kv_cache_layout()`."""

    TPUModelRunner.__module__ = RUNNER_MODULE
    module.TPUModelRunner = TPUModelRunner
    sys.modules[RUNNER_MODULE] = module
    return "stand-in"
