"""Every code block of README.md, CONTRIBUTING.md and docs/*.md runs as written (or is
checked), so docs cannot rot.

- ```python blocks run, in page order, on CPU. The blocks of one page share one
  namespace, as in a notebook: a block may use names an earlier block of the same page
  defined (its test runs those blocks first). A block importing torch or vLLM skips,
  saying so, when that package is missing.
- A python block that is deliberately not runnable says so on its first line, visibly:
  `# not run: <reason>` (it must still parse). Its test skips with that reason.
- ```bash / ```sh / ```console blocks are checked, not run (they install packages or
  take minutes): the shell parses them; every `jax-kvoffload` / `python -m jax_kvoffload`
  command parses with the real command line; every `python benchmarks/<x>.py` command
  names a script that exists and whose argument parser accepts it; every `pip install`
  of this project names extras pyproject.toml defines; a `--kv-transfer-config` is JSON
  naming a spec module and class that exist.
- Unlabelled blocks (diagrams, sample output) are not code; one that parses as Python
  with calls or imports is refused until it is labelled.

New pages under docs/ are covered without touching this file. Also here: relative links
and images resolve (a link's `#heading` too), and no text cites a document that is not in
the repository.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import chex
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "sh", "shell", "console"}
# Packages a block may need that the README's `pip install -e ".[test]"` does not bring.
OPTIONAL = {"torch", "vllm", "matplotlib"}
NOT_RUN = re.compile(r"#\s*not run:\s*(?P<reason>\S.*)$")
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def not_run_reason(self) -> str | None:
        first = next((ln for ln in self.code.splitlines() if ln.strip()), "")
        m = NOT_RUN.match(first.strip())
        return m.group("reason") if m else None


def blocks_of(page: Path) -> list[Block]:
    out: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        body, j = [], i + 1
        while j < len(lines) and not (
            lines[j].strip().startswith(fence) and set(lines[j].strip()) <= set(fence[0])
        ):
            # List items indent their blocks: drop the fence's indentation.
            body.append(lines[j][indent:] if lines[j][:indent].isspace() else lines[j])
            j += 1
        lang = (m["info"].split() or [""])[0].lower()
        out.append(Block(page, i + 1, lang, "\n".join(body) + "\n"))
        i = j + 1
    return out


ALL = [b for page in PAGES for b in blocks_of(page)]
PY_BLOCKS = [b for b in ALL if b.lang in PYTHON]
SHELL_BLOCKS = [b for b in ALL if b.lang in SHELL]


def test_every_page_is_found():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "CONTRIBUTING.md", "docs/index.md", "docs/start.md"} <= names
    assert PY_BLOCKS and SHELL_BLOCKS


def _imported_modules(code: str) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            mods.add(node.module.split(".")[0])
    return mods


def _missing_optional(code: str) -> list[str]:
    needed = _imported_modules(code) & OPTIONAL
    return sorted(m for m in needed if importlib.util.find_spec(m) is None)


def _run(block: Block, namespace: dict) -> None:
    # dont_inherit: the block runs as written, not under this module's __future__ imports
    # (postponed annotations would send a block's dataclass looking for its module).
    exec(compile(block.code, block.where, "exec", dont_inherit=True), namespace)


def _readme_moved_only_the_prefix(ns: dict) -> None:
    """After the README's block: blocks 32-39 of every layer hold blocks 0-7, the rest is
    untouched, and shapes and dtypes are those the engine handed over."""
    rng = np.random.default_rng(0)  # the block's own seed: its arrays, before the job
    before = [
        jnp.asarray(rng.standard_normal(ns["shape"]), jnp.bfloat16) for _ in range(ns["layers"])
    ]
    after = ns["kv_arrays"]
    chex.assert_shape(after, ns["shape"])
    chex.assert_type(after, jnp.bfloat16)
    chex.assert_trees_all_equal(after, [b.at[32:40].set(b[0:8]) for b in before])


# Checks beyond a page's own, run after its last runnable block: page name -> check.
AFTER = {"README.md": _readme_moved_only_the_prefix}


@pytest.mark.parametrize("block", PY_BLOCKS, ids=lambda b: b.where)
def test_python_block_runs(block, monkeypatch):
    ast.parse(block.code, block.where)  # even a block that is not run must parse
    reason = block.not_run_reason
    if reason is not None:
        pytest.skip(f"{block.where} is marked not run: {reason}")
    page = [b for b in PY_BLOCKS if b.page == block.page and b.not_run_reason is None]
    before = page[: page.index(block)]
    missing = _missing_optional("".join(b.code for b in [*before, block]))
    if missing:
        pytest.skip(f"{block.where} needs {', '.join(missing)}, not installed")
    monkeypatch.chdir(ROOT)
    namespace: dict = {"__name__": "__docs__"}
    for earlier in before:
        _run(earlier, namespace)
    _run(block, namespace)
    if block is page[-1] and block.page.name in AFTER and block.page.parent == ROOT:
        AFTER[block.page.name](namespace)


def test_unlabelled_blocks_are_not_code():
    for b in ALL:
        if b.lang:
            continue
        try:
            tree = ast.parse(b.code)
        except SyntaxError:
            continue
        code_like = any(
            isinstance(n, (ast.Call, ast.Import, ast.ImportFrom)) for n in ast.walk(tree)
        )
        assert not code_like, f"{b.where}: label this block ```python (it is code) or ```text"


# -- shell blocks: checked, not run ---------------------------------------------------


def _commands(code: str) -> list[list[str]]:
    """The block's commands as argument lists: continuations joined, `&&`/`;`/`|` split."""
    text = re.sub(r"\\\n", " ", code)
    commands = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
        for part in re.split(r"&&|\|\||;|\|", line):
            try:
                words = shlex.split(part)
            except ValueError:
                continue  # a quote spanning `;` inside JSON etc.: the shell check covers it
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
                words = words[1:]  # VAR=value prefixes
            if words and words[0] in {"time", "sudo"}:
                words = words[1:]
            if words:
                commands.append(words)
    return commands


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(
        f"_docs_bench_{name}", ROOT / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_bench(where: str, script: str, args: list[str]) -> None:
    path = ROOT / script
    assert path.is_file(), f"{where}: {script} does not exist"
    if path.suffix != ".py" or path.parent.name != "benchmarks":
        return
    module = _bench_module(path.stem)
    parse = getattr(module, "parse_args", None)
    if parse is None:
        return  # a script without an argument parser of ours (deviceless_compile.py)
    try:
        parse(args)
    except SystemExit as e:
        pytest.fail(f"{where}: `{script} {' '.join(args)}` is refused by its parser ({e})")


def _check_cli(where: str, args: list[str]) -> None:
    from jax_kvoffload.cli import build_parser

    try:
        ns = build_parser().parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{where}: `jax-kvoffload {' '.join(args)}` does not parse ({e})")
    if getattr(ns, "command", None) == "bench":
        _check_bench(where, f"benchmarks/{ns.name}.py", list(ns.args))
    if getattr(ns, "config_command", None) == "explain":
        assert (ROOT / ns.file).is_file() or "FILE" in ns.file.upper(), where


def _check_pip(where: str, args: list[str]) -> None:
    extras = set(_pyproject()["project"]["optional-dependencies"])
    for word in args:
        m = re.fullmatch(r"(?:-e\s*)?(?:\.|jax-kvoffload|jax_kvoffload)\[([\w,\s-]+)\]", word)
        if m:
            asked = {e.strip() for e in m.group(1).split(",")}
            assert asked <= extras, f"{where}: pip extras {sorted(asked - extras)} not defined"
        if word.startswith("-r"):
            req = word[2:] or args[args.index(word) + 1]
            assert (ROOT / req).is_file(), f"{where}: {req} does not exist"


def _check_vllm_serve(where: str, args: list[str]) -> None:
    if "--kv-transfer-config" not in args:
        return
    cfg = json.loads(args[args.index("--kv-transfer-config") + 1])
    extra = cfg["kv_connector_extra_config"]
    module = extra.get("spec_module_path")
    if module:
        # The module must import without vLLM and expose the class name lazily.
        mod = importlib.import_module(module)
        assert extra["spec_name"] in getattr(mod, "__all__", ()), (
            f"{where}: {module} does not export {extra['spec_name']}"
        )
    connector = cfg.get("kv_connector_module_path", "")
    if connector.startswith("jax_kvoffload"):  # ours (tpu-inference): imports without it
        mod = importlib.import_module(connector)
        assert cfg["kv_connector"] in getattr(mod, "__all__", ()), (
            f"{where}: {connector} does not export {cfg['kv_connector']}"
        )


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: b.where)
def test_shell_block_is_well_formed(block):
    if shutil.which("bash"):
        done = subprocess.run(["bash", "-n"], input=block.code, text=True, capture_output=True)
        assert done.returncode == 0, f"{block.where}: {done.stderr}"
    for words in _commands(block.code):
        cmd, rest = words[0], words[1:]
        if cmd == "jax-kvoffload":
            _check_cli(block.where, rest)
        elif cmd.endswith("python") or cmd.endswith("python3"):
            if rest[:2] == ["-m", "jax_kvoffload"]:
                _check_cli(block.where, rest[2:])
            elif rest[:2] == ["-m", "pip"]:
                _check_pip(block.where, rest[2:])
            elif rest and rest[0].startswith("benchmarks/"):
                _check_bench(block.where, rest[0], rest[1:])
        elif cmd in {"bash", "sh"} and rest and rest[0].startswith("benchmarks/"):
            _check_bench(block.where, rest[0], rest[1:])
        elif cmd.endswith("pip") or cmd.endswith("pip3"):
            _check_pip(block.where, rest)
        elif cmd == "vllm" and rest[:1] == ["serve"]:
            _check_vllm_serve(block.where, rest)


def test_the_shell_checks_catch_a_bad_command():
    bad = Block(ROOT / "README.md", 0, "bash", "jax-kvoffload demo --no-such-flag\n")
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        test_shell_block_is_well_formed(bad)
    bad = Block(ROOT / "README.md", 0, "bash", 'pip install -e ".[no-such-extra]"\n')
    with pytest.raises(AssertionError, match="not defined"):
        test_shell_block_is_well_formed(bad)


# -- links and references ---------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)\)")


HEADING = re.compile(r"^#{1,6}\s+(?P<title>.*?)\s*#*\s*$")


def _prose(page: Path) -> str:
    return re.sub(r"```.*?```", "", page.read_text(), flags=re.S)


def anchors(page: Path) -> set[str]:
    """The `#fragment`s a page's headings get on GitHub: lower case, punctuation other than
    `-` and `_` dropped, spaces as `-`, a repeated heading suffixed `-1`, `-2`, ..."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _prose(page).splitlines():
        m = HEADING.match(line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m["title"].strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(page: Path) -> list[str]:
    """Relative links (and images) of `page` whose file, or heading anchor, is missing."""
    broken = []
    for m in LINK.finditer(_prose(page)):
        path, _, fragment = m["target"].partition("#")
        if re.match(r"[a-z]+:", path):
            continue
        target = page.parent / path if path else page
        if not target.exists():
            broken.append(f"{m['target']} (no file {path})")
        elif fragment and target.suffix == ".md" and fragment not in anchors(target):
            broken.append(f"{m['target']} (no heading #{fragment} in {path or page.name})")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: broken links: " + "; ".join(broken)


def test_the_link_check_catches_a_missing_file_and_a_renamed_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## The `x` path, again\n\n## Dup\n## Dup\n")
    page = tmp_path / "page.md"
    good = "[a](other.md#the-x-path-again) [b](other.md#dup-1) [c](#here) [d](https://x.org/#q)"
    page.write_text(f"# Here\n\n{good}\n")
    assert broken_links(page) == []
    page.write_text("# Here\n\n[a](missing.md) [b](other.md#the-y-path) [c](#there)\n")
    assert [b.split()[0] for b in broken_links(page)] == [
        "missing.md",
        "other.md#the-y-path",
        "#there",
    ]


# Documents that were never part of the repository: cite the vLLM source file or say the fact.
FOREIGN = re.compile(
    r"\bnotes? A\d|\breference (spec|notes)\b|\bspec (section )?\d+\.\d+|\bspec \d+\.\d+"
    r"|\btests doc\b|vllm_offload_(spec|tests)\.md|jax_pallas_notes|/work/"
)


def _texts() -> list[Path]:
    here = Path(__file__).resolve()
    files = [*PAGES, ROOT / "pyproject.toml"]
    for folder in ("jax_kvoffload", "pallas_kernels", "tests", "benchmarks", ".ci"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".sh", ".md", ""}]
    return [p for p in files if p.is_file() and p.resolve() != here]


def test_no_citation_of_documents_outside_the_repository():
    found = []
    for path in _texts():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if FOREIGN.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "cites notes/spec sections that are not in the repository:\n" + "\n".join(
        found
    )
