"""The type check's configuration (`[tool.mypy]` in pyproject.toml) keeps up with the tree.

mypy itself runs in .ci/run (`python -m mypy`, about 1.5 min without a cache: too slow for
the fast suite; CONTRIBUTING.md, "Checking types"). These checks are cheap and catch
what mypy would not: a module pattern that matches nothing is only a note to mypy, so a
public module renamed or added would silently drop out of the strict list.
"""

from __future__ import annotations

import ast
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jax_kvoffload", "pallas_kernels")

# Re-exported by an __init__ but not checked strictly, and why.
NOT_STRICT = {
    "jax_kvoffload.demo": "the demo application behind `jax-kvoffload demo`, not library API",
    "jax_kvoffload.bridge.tpu_inference._classes": "subclasses tpu-inference's untyped classes",
    "pallas_kernels.blocks.api": "its own override: typed entries, unannotated jitted bodies",
    "pallas_kernels.blocks.mosaic_gpu": "kernel bodies on Pallas refs (only a config exported)",
    "pallas_kernels.blocks.tpu": "kernel bodies on Pallas refs (only a config exported)",
    "pallas_kernels.blocks.triton": "kernel bodies on Pallas refs (only a config exported)",
}


def _mypy() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]


def _strict_modules() -> set[str]:
    (strict,) = [o for o in _mypy()["overrides"] if o.get("disallow_untyped_defs") is True]
    return set(strict["module"])


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_file(name: str) -> pathlib.Path | None:
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _public_modules() -> dict[str, str]:
    """Each package `__init__` and each module of ours it imports names from -> why."""
    out: dict[str, str] = {}
    for pkg in PACKAGES:
        for init in sorted((ROOT / pkg).rglob("__init__.py")):
            package = _module_name(init)
            out.setdefault(package, "a package __init__")
            for node in ast.walk(ast.parse(init.read_text())):
                if not isinstance(node, ast.ImportFrom):
                    continue
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    name = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    name = node.module or ""
                if name.split(".")[0] in PACKAGES and _module_file(name) is not None:
                    out.setdefault(name, f"re-exported by {package}")
    return out


def test_every_public_module_is_checked_strictly():
    strict = _strict_modules()
    missing = {
        name: why
        for name, why in _public_modules().items()
        if name not in strict and name not in NOT_STRICT
    }
    assert not missing, (
        f"public modules missing from the strict [[tool.mypy.overrides]] of pyproject.toml: "
        f"{missing}; add them there (or to NOT_STRICT here, with the reason)"
    )


def test_every_module_the_config_names_exists():
    names = [m for o in _mypy()["overrides"] for m in o["module"] if not m.endswith(".*")]
    ours = [m for m in names if m.split(".")[0] in PACKAGES]
    gone = [m for m in ours if _module_file(m) is None]
    assert not gone, f"[tool.mypy] names modules that do not exist: {gone}; rename or drop them"
    assert set(NOT_STRICT) <= set(_public_modules()), "NOT_STRICT names a module no one exports"


def test_ci_runs_the_type_check_before_the_tests():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    steps = [
        i for i, line in enumerate(lines) if re.fullmatch(r"python -m (mypy|pytest)\b.*", line)
    ]
    kinds = [lines[i].split()[2] for i in steps]
    assert "mypy" in kinds, ".ci/run no longer runs `python -m mypy`"
    assert kinds.index("mypy") < kinds.index("pytest"), ".ci/run must type-check before pytest"


def test_the_checker_is_pinned_exactly_in_the_test_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [r for r in project["optional-dependencies"]["test"] if r.startswith("mypy")]
    assert len(pins) == 1 and re.fullmatch(r"mypy==\d+\.\d+\.\d+", pins[0]), pins
