"""A prefix-reuse demo on a small Flax NNX transformer with a paged KV cache.

Not part of the library core (which never imports it): `jax-kvoffload demo` runs
`run_scenario`; see docs/demo.md.

Names load on first use, like `jax_kvoffload`'s own: the configs and checks
(`ScenarioConfig`, `check_tiers`, ...) and the two-process parent import no jax, so the
command line reports a bad argument at once instead of after importing jax (8-17 s on
a busy machine).
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the private module defining it
_WHERE = {
    "DemoConfigError": "_config",
    "DemoModelConfig": "_config",
    "Progress": "_config",
    "ScenarioConfig": "_config",
    "check_tiers": "_config",
    "check_mesh_sizes": "_config",
    "parse_mesh_sizes": "_config",
    "tier_entry": "_config",
    "StreamProgress": "_report",
    "format_summary": "_report",
    "format_two_process": "_report",
    "run_two_process": "_two_process",
    "DemoTransformer": "_model",
    "build_offloader": "_scenario",
    "run_scenario": "_scenario",
    "CACHE_LAYOUT": "_serving",
    "BlockAllocator": "_serving",
    "OutOfBlocksError": "_serving",
    "PagedServer": "_serving",
    "Request": "_serving",
    "block_hashes": "_serving",
    "run_reader": "_tiered",
    "run_writer": "_tiered",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'jax_kvoffload.demo' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"jax_kvoffload.demo.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
