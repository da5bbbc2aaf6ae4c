"""Where tpu-inference may be imported: only inside `jax_kvoffload.bridge.tpu_inference`,
and there only inside functions (the classes are built on first use), so that importing
our package, or even that module, imports neither tpu-inference nor vLLM."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BRIDGE = ROOT / "jax_kvoffload" / "bridge" / "tpu_inference"
LAZY = ("tpu_inference", "vllm", "torch")


def _type_checking(node: ast.If) -> bool:
    """Whether `node` is `if TYPE_CHECKING:` (its imports are the type checker's only)."""
    test = node.test
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING" and not node.orelse


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, module, at module level) of every import in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` blocks count as not imported
        if isinstance(node, ast.If) and not _type_checking(node):
            top.update(id(n) for n in node.body)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, id(node) in top))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, id(node) in top) for a in node.names]
    return out


def violations(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        inside = BRIDGE in path.parents
        for line, module, top in _imports(path):
            root = module.split(".")[0]
            if root == "tpu_inference" and not inside:
                found.append(f"{path}:{line}: imports tpu_inference outside bridge/tpu_inference")
            elif root in LAZY and inside and top:
                found.append(f"{path}:{line}: imports {root} at module level")
    return found


def test_tpu_inference_is_imported_only_lazily_inside_its_bridge():
    assert violations(sorted((ROOT / "jax_kvoffload").rglob("*.py"))) == []


def test_the_rule_sees_a_breach(tmp_path):
    outside = tmp_path / "jax_kvoffload" / "store" / "_bad.py"
    outside.parent.mkdir(parents=True)
    outside.write_text("def f():\n    import tpu_inference\n")
    assert len(violations([outside])) == 1
    global BRIDGE
    saved, BRIDGE = BRIDGE, tmp_path / "bridge"
    try:
        eager = BRIDGE / "_bad.py"
        eager.parent.mkdir()
        eager.write_text("from tpu_inference.offload import tpu_offload_connector\n")
        assert len(violations([eager])) == 1
        # Any other module-level `if` imports when the module does.
        eager.write_text("import os\nif os.environ:\n    import vllm\n")
        assert len(violations([eager])) == 1
        typed = BRIDGE / "_typed.py"
        typed.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import vllm\n")
        assert violations([typed]) == []
    finally:
        BRIDGE = saved


def test_importing_the_bridge_imports_neither_tpu_inference_nor_vllm():
    code = (
        "import sys, jax_kvoffload.bridge.tpu_inference as m\n"
        "assert 'TPUOffloadConnector' in m.__all__\n"
        "print(sorted(x for x in ('tpu_inference', 'vllm', 'torch') if x in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
