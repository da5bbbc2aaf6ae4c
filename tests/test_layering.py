"""The import rules of docs/architecture.md and STYLE, checked on the source.

- No package imports another package's private `_modules` (each package exports what
  others use, semi-public parts from its `internals` module).
- `pallas_kernels` is standalone: it imports nothing of `jax_kvoffload`.
- One-way layers: config and the helpers (`_interrupts`, `_log_once`, `_threads`) at the bottom;
  errors and stats above config; store, tiers and hostmem above those and independent
  of each other; transfer above hostmem (it moves bytes into hostmem's pools) and
  independent of store and tiers; assembly above them; the offloader package above
  assembly and below bridge; demo and CLI on top (only they import the `jax_kvoffload`
  facade's names, `from jax_kvoffload import KVOffloader`; the bridge never imports
  them). A lower package never imports a higher one.
- Interrupt safety in one place: only the public entry points and the job cores hold
  SIGINT (`SIGNAL_HOLDERS` import `signal` or `deferred_interrupts`); the layers they
  call are plain code.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Helpers every package but config may import: they import nothing of ours (warning
# once per kind of event; starting threads and saying when the process is out of them).
HELPERS = {"_interrupts", "_log_once", "_threads"}
# package -> the jax_kvoffload packages (and pallas_kernels) it may import.
LOWER = {
    "config": set(),
    **{helper: set() for helper in HELPERS},
    "errors": {"config"},
    "stats": {"config", "errors", *HELPERS},
    "store": {"config", "errors", *HELPERS},
    "tiers": {"config", "errors", *HELPERS},
    "hostmem": {"config", "errors", *HELPERS},
    "transfer": {"config", "errors", "hostmem", "pallas_kernels", *HELPERS},
    "assembly": {"config", "errors", "stats", "store", "tiers", "transfer", "hostmem", *HELPERS},
    # KVOffloader: above the host tier's parts and their assembly, below bridge/demo/cli.
    "offloader": {
        "config",
        "errors",
        "stats",
        "store",
        "tiers",
        "transfer",
        "hostmem",
        "assembly",
        "pallas_kernels",
        *HELPERS,
    },
}
# The vLLM / torch / tpu-inference adapters: above the offloader, below demo and CLI.
LOWER["bridge"] = {*LOWER["offloader"], "offloader"}
# The demo: anything but the CLI, and the facade (`from jax_kvoffload import X`).
LOWER["demo"] = {*LOWER["bridge"], "bridge", "jax_kvoffload"}
# The modules of ours with subpackages or modules of these names; any other name in
# `from jax_kvoffload import name` is one of the facade's re-exports.
PACKAGES = {p.stem for p in (ROOT / "jax_kvoffload").iterdir() if p.suffix == ".py" or p.is_dir()}

# The only modules that may hold SIGINT (docs/architecture.md, "Interrupts"): the helper,
# the entry points (KVOffloader's; the tpu-inference worker's, driven by their runner),
# and the job cores of the worker engines and of the tiers.
SIGNAL_HOLDERS = {
    "jax_kvoffload/_interrupts.py",
    "jax_kvoffload/offloader/_offloader.py",
    "jax_kvoffload/bridge/tpu_inference/_worker.py",
    "jax_kvoffload/transfer/_job_core.py",
    "jax_kvoffload/tiers/_job_runner.py",
}


def _package_of(path: Path) -> str:
    parts = path.parts
    rel = parts[len(parts) - parts[::-1].index("jax_kvoffload") :]
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return out


def _violations(paths, rule) -> list[str]:
    found = {}
    for path in paths:
        for line, module in _imports(path):
            reason = rule(path, module)
            if reason:  # one report per import statement
                found.setdefault((str(path), line), f"{path}:{line}: {module}: {reason}")
    return sorted(found.values())


def private_import(path: Path, module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "jax_kvoffload" or len(parts) < 3 or not parts[2].startswith("_"):
        return None
    if parts[1] == _package_of(path):
        return None
    return f"reaches into {parts[1]}'s private module {parts[2]}"


def layer_breach(path: Path, module: str) -> str | None:
    pkg = _package_of(path)
    if pkg not in LOWER:
        return None
    parts = module.split(".")
    if parts[0] == "pallas_kernels":
        target = "pallas_kernels"
    elif parts[0] == "jax_kvoffload" and len(parts) > 1:
        target = parts[1] if parts[1] in PACKAGES else "jax_kvoffload"
    else:
        return None
    if target == pkg or target in LOWER[pkg]:
        return None
    return f"{pkg} may import only {sorted(LOWER[pkg]) or 'nothing of ours'}"


def standalone_breach(path: Path, module: str) -> str | None:
    return "pallas_kernels imports jax_kvoffload" if module.startswith("jax_kvoffload") else None


def signal_breach(path: Path, module: str) -> str | None:
    """A module outside `SIGNAL_HOLDERS` that holds or swaps SIGINT itself."""
    parts = path.parts
    rel = "/".join(parts[len(parts) - 1 - parts[::-1].index("jax_kvoffload") :])
    if rel in SIGNAL_HOLDERS:
        return None
    if module in ("signal", "_signal") or module.endswith(".deferred_interrupts"):
        return (
            "holds SIGINT below the entry points: take the step in the caller's "
            "deferred_interrupts block (the public entry point or the job core)"
        )
    return None


LIBRARY = sorted((ROOT / "jax_kvoffload").rglob("*.py"))


@pytest.mark.parametrize(
    ("paths", "rule"),
    [
        (LIBRARY, private_import),
        (LIBRARY, layer_breach),
        (sorted((ROOT / "pallas_kernels").rglob("*.py")), standalone_breach),
        (LIBRARY, signal_breach),
    ],
    ids=["no-private-imports", "one-way-layers", "pallas-kernels-standalone", "signals-at-entries"],
)
def test_import_rules(paths, rule):
    assert paths
    assert _violations(paths, rule) == []


def test_the_rules_see_a_breach(tmp_path):
    """The checks can fail: a planted store module importing the bridge and a tier's
    private module breaks the layers twice and the privacy once."""
    pkg = tmp_path / "jax_kvoffload" / "store"
    pkg.mkdir(parents=True)
    bad = pkg / "_bad.py"
    bad.write_text(
        "from jax_kvoffload.bridge import vllm\nfrom jax_kvoffload.tiers._disk import DiskTier\n"
    )
    assert len(_violations([bad], layer_breach)) == 2
    assert len(_violations([bad], private_import)) == 1
    helper = tmp_path / "jax_kvoffload" / "_threads.py"  # a helper is below everything
    helper.write_text("from jax_kvoffload.errors import KVOffloadStateError\n")
    assert len(_violations([helper], layer_breach)) == 1


def test_hostmem_sits_below_transfer(tmp_path):
    """A planted hostmem module importing transfer, the store, pallas_kernels and
    transfer's private module breaks the layers four times and the privacy once; the
    same imports the other way (transfer importing hostmem's public names) are fine."""
    pkg = tmp_path / "jax_kvoffload" / "hostmem"
    pkg.mkdir(parents=True)
    bad = pkg / "_bad.py"
    bad.write_text(
        "from jax_kvoffload.transfer import TransferEngine\n"
        "from jax_kvoffload.store import HostStore\n"
        "import pallas_kernels\n"
        "from jax_kvoffload.transfer._jobs import TransferError\n"
    )
    assert len(_violations([bad], layer_breach)) == 4
    assert len(_violations([bad], private_import)) == 1
    up = tmp_path / "jax_kvoffload" / "transfer"
    up.mkdir()
    good = up / "_good.py"
    good.write_text(
        "from jax_kvoffload.hostmem import HostPool\n"
        "from jax_kvoffload.hostmem.internals import check_index\n"
    )
    assert _violations([good], layer_breach) == []
    assert _violations([good], private_import) == []


def test_the_offloader_layer_sees_a_breach(tmp_path):
    """The offloader package's rule can fail both ways: a planted offloader module
    importing the bridge, or a planted store, tiers or transfer module importing the
    offloader, is a breach each; the offloader reaching into transfer's private
    `_engine` breaks the privacy rule."""
    root = tmp_path / "jax_kvoffload"
    up = root / "offloader" / "_bad.py"
    up.parent.mkdir(parents=True)
    up.write_text(
        "from jax_kvoffload.bridge import vllm\nfrom jax_kvoffload.transfer._engine import X\n"
    )
    assert len(_violations([up], layer_breach)) == 1
    assert len(_violations([up], private_import)) == 1
    down = []
    for pkg in ("store", "tiers", "transfer", "assembly"):
        path = root / pkg / "_bad.py" if pkg != "assembly" else root / "assembly.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("from jax_kvoffload.offloader import KVOffloader\n")
        down.append(path)
    assert len(_violations(down, layer_breach)) == 4


def test_the_offloader_sits_above_hostmem_and_below_the_bridge(tmp_path):
    """hostmem importing the offloader is a breach; the bridge importing it is not, and
    the bridge importing the demo, the CLI or the facade's names is (once each)."""
    root = tmp_path / "jax_kvoffload"
    down = root / "hostmem" / "_bad.py"
    down.parent.mkdir(parents=True)
    down.write_text("from jax_kvoffload.offloader import KVOffloader\n")
    assert len(_violations([down], layer_breach)) == 1
    bridge = root / "bridge" / "_x.py"
    bridge.parent.mkdir(parents=True)
    bridge.write_text("from jax_kvoffload.offloader import KVOffloader\n")
    assert _violations([bridge], layer_breach) == []
    bridge.write_text(
        "from jax_kvoffload.demo import run\nfrom jax_kvoffload import cli\n"
        "from jax_kvoffload import KVOffloader\n"
    )
    assert len(_violations([bridge], layer_breach)) == 3
    demo = root / "demo" / "_x.py"
    demo.parent.mkdir(parents=True)
    demo.write_text(
        "from jax_kvoffload import KVOffloader\nfrom jax_kvoffload.bridge import vllm\n"
    )
    assert _violations([demo], layer_breach) == []


def test_pallas_kernels_standalone_sees_a_breach(tmp_path):
    """A planted kernel module importing the library (a package, or a name of it) breaks
    the standalone rule once per statement; one importing jax does not."""
    bad = tmp_path / "pallas_kernels" / "blocks" / "_bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text(
        "import jax\nfrom jax_kvoffload.config import OffloadingConfig\n"
        "import jax_kvoffload.errors\n"
    )
    assert len(_violations([bad], standalone_breach)) == 2


def test_holding_sigint_below_the_entry_points_is_a_breach(tmp_path):
    """The job book importing `deferred_interrupts`, or a tier module importing `signal`,
    is a breach each; the offloader's entry points and the job cores may."""
    root = tmp_path / "jax_kvoffload"
    book = root / "offloader" / "_job_book.py"
    book.parent.mkdir(parents=True)
    book.write_text("from jax_kvoffload._interrupts import deferred_interrupts\n")
    tier = root / "tiers" / "_disk.py"
    tier.parent.mkdir(parents=True)
    tier.write_text("import signal\n")
    assert len(_violations([book, tier], signal_breach)) == 2
    allowed = []
    for rel in SIGNAL_HOLDERS - {"jax_kvoffload/_interrupts.py"}:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            "import signal\nfrom jax_kvoffload._interrupts import deferred_interrupts\n"
        )
        allowed.append(path)
    assert _violations(allowed, signal_breach) == []
