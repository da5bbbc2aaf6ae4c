"""docs/observability.md lists every logger the library defines, with the levels it
really logs at, so the table cannot fall behind the code."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "observability.md"
LEVELS = {"DEBUG": "debug", "INFO": "info", "WARNING": "warning", "ERROR": "error|exception"}


def defined_loggers() -> dict[str, str]:
    """Module name -> source, for every module that makes a logger of its name."""
    out = {}
    for path in sorted((ROOT / "jax_kvoffload").rglob("*.py")):
        source = path.read_text()
        if "logging.getLogger(__name__)" in source:
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[module] = source
    return out


def documented() -> dict[str, set[str]]:
    """Logger -> the levels the page's table gives it (continuation rows included)."""
    section = PAGE.read_text().split("## Logs", 1)[1]
    out: dict[str, set[str]] = {}
    names: list[str] = []
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("logger", "---"):
            continue
        if cells[0]:
            names = re.findall(r"`(jax_kvoffload[\w.]*)`", cells[0])
        for name in names:
            out.setdefault(name, set()).update(re.findall(r"DEBUG|INFO|WARNING|ERROR", cells[1]))
    return out


def test_every_logger_is_documented_and_nothing_else():
    assert set(documented()) == set(defined_loggers())


def test_each_documented_level_is_one_the_module_logs_at_and_no_level_is_missing():
    docs = documented()
    for module, source in defined_loggers().items():
        used = {
            level for level, calls in LEVELS.items() if re.search(rf"logger\.({calls})\(", source)
        }
        assert docs[module] == used, module
