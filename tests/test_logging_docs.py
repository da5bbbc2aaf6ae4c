"""docs/observability.md lists every logger the library defines, with the levels it
really logs at, so the table cannot fall behind the code."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "observability.md"
LEVELS = {"DEBUG": "debug", "INFO": "info", "WARNING": "warning", "ERROR": "error|exception"}


def defined_loggers() -> dict[str, str]:
    """Logger name -> the source of every module that logs through it: a module's own
    logger (`getLogger(__name__)`) or another's it names (the disk tier's helpers log
    as the tier)."""
    out: dict[str, str] = {}
    for path in sorted((ROOT / "jax_kvoffload").rglob("*.py")):
        source = path.read_text()
        names = re.findall(r'logger = logging\.getLogger\((__name__|"[\w.]+")\)', source)
        assert len(names) <= 1, f"{path}: one logger per module, got {names}"
        if names:
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            name = module if names[0] == "__name__" else names[0].strip('"')
            out[name] = out.get(name, "") + source
    return out


def levels_used(source: str) -> set[str]:
    """The levels a source logs at: `logger.<level>(...)`, and `log_once(logger, ...)`
    (WARNING the first time, DEBUG after)."""
    used = {level for level, calls in LEVELS.items() if re.search(rf"logger\.({calls})\(", source)}
    if re.search(r"log_once\(\s*logger\b", source):
        used |= {"WARNING", "DEBUG"}
    return used


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
        assert docs[module] == levels_used(source), module


def test_the_level_check_sees_helpers_and_log_once():
    """The check can fail: a documented level the code lost, or a log_once not documented."""
    assert levels_used('log_once(\n    logger, "kind", "msg")') == {"WARNING", "DEBUG"}
    assert levels_used("logger.exception('x')") == {"ERROR"}
    assert levels_used("logger.info('x')") == {"INFO"}
