"""The manifest of vLLM's offloading tests run against ours (expected_differences.toml).

Read by the pytest plugin (``vllm_substitution``) in the subprocess that runs vLLM's
tests, and by ``test_vllm_suite.py``. Imports nothing beyond the standard library.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import tomllib
from typing import Any

MANIFEST = pathlib.Path(__file__).with_name("expected_differences.toml")

# kind -> the prefix of the reason pytest shows. "environment" skips; the others are
# strict xfails.
KINDS = {
    "real-being-fixed": "real difference, being fixed",
    "real-unassigned": "real difference, not yet assigned",
    "design": "by design",
    "harness": "outside the substitution",
    "environment": "cannot run here",
}


@dataclasses.dataclass
class Entry:
    """Tests expected to differ (or to be skipped), for one reason.

    Attributes:
      tests: node ids relative to the sdist's root; ``*`` matches anything.
      kind: one of ``KINDS``.
      reason: what differs, and where (shown by pytest).
      match: a regex the failure must contain (xfail kinds), so that a listed test
        failing for another reason is reported.
    """

    tests: list[str]
    kind: str
    reason: str
    match: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.tests[:1]}: kind={self.kind!r}, use one of {list(KINDS)}")
        if not self.reason.strip():
            raise ValueError(f"{self.tests[:1]}: an entry needs a reason")
        self._patterns = [re.compile(re.escape(t).replace(r"\*", ".*")) for t in self.tests]
        self.hits = dict.fromkeys(self.tests, 0)  # per listed test: collected items matched
        if self.match is not None:
            re.compile(self.match)

    def matches(self, nodeid: str) -> bool:
        found = False
        for test, pattern in zip(self.tests, self._patterns, strict=True):
            if pattern.fullmatch(nodeid):
                self.hits[test] += 1
                found = True
        return found

    @property
    def marker_reason(self) -> str:
        return f"{KINDS[self.kind]}: {self.reason}"


@dataclasses.dataclass
class Manifest:
    files: list[str]  # what runs: files, or node ids for single tests
    excluded: dict[str, str]  # offloading test files (or folders) not run -> why
    entries: list[Entry]


def load(path: pathlib.Path = MANIFEST) -> Manifest:
    with path.open("rb") as f:
        data: dict[str, Any] = tomllib.load(f)
    return Manifest(
        files=list(data["files"]),
        excluded=dict(data.get("excluded", {})),
        entries=[Entry(**raw) for raw in data.get("entry", [])],
    )
