"""pyproject.toml's promises against what is installed, checked offline.

CI has no package index to ask, so these tests read what the installed distributions
declare about themselves (their versions, `Requires-Python` and extras) and compare it
with pyproject.toml, the README and `.ci/run`:

- `requires-python` is exactly the oldest Python the oldest allowed jax/jaxlib accept
  (checked when the installed jax is that oldest release, as in CI);
- every installed dependency satisfies the declared range, and the running Python
  satisfies `requires-python`; ruff's target and the README say the same version;
- each core dependency is imported by the library, the accelerator extras name extras
  that jax defines, `[torch]` is a range and `[vllm]` is the release the plug-in mirrors;
- CI installs the CPU torch before anything else and never an extra or a vLLM install
  that would pull a CUDA torch.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
CORE = {Requirement(r).name: Requirement(r) for r in PROJECT["dependencies"]}
EXTRAS = {
    name: [Requirement(r) for r in reqs] for name, reqs in PROJECT["optional-dependencies"].items()
}
REQUIRES_PYTHON = SpecifierSet(PROJECT["requires-python"])
# The vLLM release whose offloading boundary the bridge mirrors (docs/vllm.md).
VLLM_MIRRORED = "0.33.0"
# The one torch CI installs (a CPU build on the CI machines' disk).
CI_TORCH = "2.13.0"


def lower_bound(spec: SpecifierSet) -> Version:
    bounds = [Version(s.version) for s in spec if s.operator in (">=", "==", "~=")]
    assert bounds, f"{spec} has no lower bound"
    return max(bounds)


def installed(name: str) -> md.Distribution | None:
    try:
        return md.distribution(name)
    except md.PackageNotFoundError:
        return None


def min_python(dist: md.Distribution) -> Version:
    return lower_bound(SpecifierSet(dist.metadata.get("Requires-Python") or ">=0"))


PY_MIN = lower_bound(REQUIRES_PYTHON)


def test_running_python_is_admitted():
    here = ".".join(map(str, sys.version_info[:3]))
    assert REQUIRES_PYTHON.contains(here), f"Python {here} is outside {REQUIRES_PYTHON}"


def test_requires_python_is_what_the_oldest_jax_needs():
    """Exactly: on the claimed minimum the oldest allowed jax/jaxlib install, and not lower."""
    needs = {}
    for name in ("jax", "jaxlib"):
        dist, oldest = installed(name), lower_bound(CORE[name].specifier)
        if Version(dist.version) != oldest:
            pytest.skip(
                f"{name} {dist.version} is installed, not the oldest allowed {oldest}: its "
                "Requires-Python says nothing about the oldest one (CI checks it)"
            )
        needs[name] = min_python(dist)
    assert max(needs.values()) == PY_MIN, (
        f"requires-python = {REQUIRES_PYTHON}, but the oldest allowed jax/jaxlib need "
        f"{needs}: state the real minimum"
    )


def test_requires_python_admits_every_installed_dependency():
    """No installed dependency refuses the oldest Python we claim (jax 0.10.2 refuses 3.10)."""
    for name, req in CORE.items():
        dist = installed(name)
        assert dist is not None, f"core dependency {name} is not installed"
        if Version(dist.version) == lower_bound(req.specifier or SpecifierSet(">=0")):
            assert min_python(dist) <= PY_MIN, f"{name} {dist.version} needs a newer Python"


@pytest.mark.parametrize(
    "req",
    [*CORE.values(), *EXTRAS["test"]],
    ids=lambda r: r.name,
)
def test_installed_versions_are_in_the_declared_range(req):
    dist = installed(req.name)
    if dist is None and req not in CORE.values():
        pytest.skip(f"test tool {req.name} is not installed here")
    assert dist is not None, f"{req.name} is declared but not installed"
    assert req.specifier.contains(dist.version, prereleases=True), (
        f"{req.name} {dist.version} is installed but pyproject.toml allows {req.specifier}"
    )


def test_ruff_and_readme_state_the_same_python():
    target = PYPROJECT["tool"]["ruff"]["target-version"]
    assert target == f"py{PY_MIN.major}{PY_MIN.minor}", target
    readme = (ROOT / "README.md").read_text()
    claims = set(re.findall(r"Python\s*(?:>=|≥)\s*(3\.\d+)", readme))
    assert claims == {f"{PY_MIN.major}.{PY_MIN.minor}"}, claims


def test_jax_has_an_upper_bound_covering_the_tested_range():
    for name in ("jax", "jaxlib"):
        spec = CORE[name].specifier
        assert any(s.operator in ("<", "<=") for s in spec), f"{name} has no upper bound"
        for tested in ("0.10.2", "0.11.0", "0.11.9"):  # CI .. the GPU machines
            assert spec.contains(tested), f"{name} {spec} excludes the tested {tested}"
        assert not spec.contains("0.12.0"), f"{name} {spec} admits an untested release"


def _imported_top_level() -> set[str]:
    names = set()
    for pkg in ("jax_kvoffload", "pallas_kernels"):
        for path in (ROOT / pkg).rglob("*.py"):
            text = path.read_text()
            names |= set(re.findall(r"^\s*(?:from|import)\s+(\w+)", text, flags=re.M))
    return names


def test_every_core_dependency_is_imported_by_the_library():
    used = _imported_top_level()
    for name in CORE:
        module = {"jaxlib": "jax"}.get(name, name)  # jaxlib is jax's backend, never imported
        assert module in used, f"core dependency {name} is imported nowhere in the library"


def test_chex_is_a_test_dependency_the_tests_use():
    assert "chex" not in CORE
    assert "chex" in {r.name for r in EXTRAS["test"]}
    uses = re.compile(r"^(import chex|from chex import)", re.M)
    users = [p for p in (ROOT / "tests").rglob("*.py") if uses.search(p.read_text())]
    assert users, "chex is in [test] but no test imports it"


@pytest.mark.parametrize("extra", ["cuda", "cuda12", "tpu"])
def test_accelerator_extras_are_jax_extras_of_the_same_range(extra):
    (req,) = EXTRAS[extra]
    assert req.name == "jax" and req.extras, req
    assert req.specifier == CORE["jax"].specifier, (req, CORE["jax"])
    provided = set(installed("jax").metadata.get_all("Provides-Extra") or ())
    assert req.extras <= provided, f"jax {installed('jax').version} lacks {req.extras}"


def test_torch_extra_is_a_range_that_admits_the_ci_torch():
    (req,) = EXTRAS["torch"]
    assert not any(s.operator in ("==", "===") for s in req.specifier), req
    assert req.specifier.contains(CI_TORCH), req
    dist = installed("torch")
    if dist is not None:
        assert req.specifier.contains(Version(dist.version).base_version), dist.version


def test_vllm_extra_is_the_mirrored_release():
    (req,) = EXTRAS["vllm"]
    assert str(req.specifier) == f"=={VLLM_MIRRORED}", req
    dist = installed("vllm")
    if dist is not None:
        assert dist.version == VLLM_MIRRORED, dist.version


def test_test_extra_never_pulls_torch_vllm_or_a_gpu_jax():
    for req in EXTRAS["test"]:
        assert req.name not in {"torch", "vllm"}, req
        assert not (req.name == "jax" and req.extras), req


def _ci_pip_installs() -> list[str]:
    text = re.sub(r"\\\n", " ", (ROOT / ".ci" / "run").read_text())
    return [
        line.split("pip install", 1)[1]
        for line in text.splitlines()
        if "pip install" in line and not line.lstrip().startswith("#")
    ]


def test_ci_installs_the_cpu_torch_first_and_nothing_that_pulls_a_cuda_torch():
    installs = _ci_pip_installs()
    first = next(i for i in installs if "--upgrade pip" not in i)
    assert f'"torch=={CI_TORCH}"' in first, f"the first install in .ci/run is not torch: {first}"
    for line in installs:
        for extras in re.findall(r"\.\[([^\]]*)\]", line):
            asked = {e.strip() for e in extras.split(",")}
            assert asked <= set(EXTRAS), f".ci/run asks for undefined extras {asked}"
            assert not asked & {"cuda", "cuda12", "tpu", "vllm", "torch"}, line
        if re.search(r"\bvllm\b", line):
            assert "--no-deps" in line, f"vLLM installed with its deps (CUDA torch): {line}"
        assert "jax[cuda" not in line and "jax[tpu" not in line, line
