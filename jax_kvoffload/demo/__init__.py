"""A prefix-reuse demo on a small Flax NNX transformer with a paged KV cache.

Not part of the library core (which never imports it): `jax-kvoffload demo` runs
`run_scenario`; see docs/demo.md.
"""

from jax_kvoffload.demo._model import DemoConfigError as DemoConfigError
from jax_kvoffload.demo._model import DemoModelConfig as DemoModelConfig
from jax_kvoffload.demo._model import DemoTransformer as DemoTransformer
from jax_kvoffload.demo._report import StreamProgress as StreamProgress
from jax_kvoffload.demo._report import format_summary as format_summary
from jax_kvoffload.demo._report import format_two_process as format_two_process
from jax_kvoffload.demo._scenario import ScenarioConfig as ScenarioConfig
from jax_kvoffload.demo._scenario import build_offloader as build_offloader
from jax_kvoffload.demo._scenario import run_scenario as run_scenario
from jax_kvoffload.demo._scenario import tier_entry as tier_entry
from jax_kvoffload.demo._serving import CACHE_LAYOUT as CACHE_LAYOUT
from jax_kvoffload.demo._serving import BlockAllocator as BlockAllocator
from jax_kvoffload.demo._serving import OutOfBlocksError as OutOfBlocksError
from jax_kvoffload.demo._serving import PagedServer as PagedServer
from jax_kvoffload.demo._serving import Request as Request
from jax_kvoffload.demo._serving import block_hashes as block_hashes
from jax_kvoffload.demo._tiered import run_reader as run_reader
from jax_kvoffload.demo._tiered import run_two_process as run_two_process
from jax_kvoffload.demo._tiered import run_writer as run_writer

__all__ = [
    "CACHE_LAYOUT",
    "BlockAllocator",
    "DemoConfigError",
    "DemoModelConfig",
    "DemoTransformer",
    "OutOfBlocksError",
    "PagedServer",
    "Request",
    "ScenarioConfig",
    "StreamProgress",
    "block_hashes",
    "build_offloader",
    "format_summary",
    "format_two_process",
    "run_reader",
    "run_scenario",
    "run_two_process",
    "run_writer",
    "tier_entry",
]
