"""Deviceless compile: the kernels compile for a TPU v5e (libtpu) and an H100, sm_90a
(jax CUDA plugin) without the hardware. Each platform skips, saying why, where its
plugin is not installed; CI runs them in separate venvs (docs/kernels.md)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "deviceless_compile.py"
_spec = importlib.util.spec_from_file_location("deviceless_compile", _PATH)
dc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dc)

PARAMS = [
    (platform, backend, case)
    for platform, backends in dc.PLATFORM_BACKENDS.items()
    for backend in backends
    for case in dc.CASES
]


@pytest.fixture(scope="module")
def devices():
    cache = {}

    def get(platform):
        reason = dc.missing_plugin(platform)
        if reason:
            pytest.skip(f"deviceless {platform} compile needs its plugin: {reason}")
        if platform not in cache:
            cache[platform] = dc.compile_only_devices(platform)
        return cache[platform]

    return get


@pytest.mark.parametrize(
    ("platform", "backend", "case"), PARAMS, ids=[f"{p}-{b}-{c[0]}" for p, b, c in PARAMS]
)
def test_kernels_compile_without_the_device(devices, platform, backend, case):
    assert dc.compile_case(devices(platform), backend, case) > 0


SHARDED = [(p, b) for p, backends in dc.PLATFORM_BACKENDS.items() for b in backends]


# (blocks split?, devices needed, what): heads sharded over every device of the topology
# (the shard_map path, docs/kernels.md); blocks over one mesh axis and heads over the
# other (tpu-inference's attention-DP meshes: each device moves the ids it owns, the
# gathered rows combined with a psum).
MESHES = {"sharded": (False, 2), "blocks-and-heads": (True, 4)}


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize(("platform", "backend"), SHARDED, ids=[f"{p}-{b}" for p, b in SHARDED])
def test_kernels_compile_per_device_on_a_sharded_mesh(devices, platform, backend, mesh):
    blocks, needed = MESHES[mesh]
    devs = devices(platform)
    if len(devs) < needed:
        pytest.skip(f"the {platform} compile topology has {len(devs)} devices (needs {needed})")
    assert dc.compile_sharded(devs, backend, blocks=blocks) > 0
