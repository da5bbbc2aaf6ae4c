"""jax_kvoffload: JAX/XLA-portable KV-cache offload for LLM serving.

Subpackages:
  config    vLLM's offloading boundary (OffloadingConfig) and its translation rules.
  store     the scheduler-side host store (chunk bookkeeping, eviction, events).
  transfer  the worker-side transfer engine (gather/scatter kernels + device_put).
  hostmem   host memory: the pools the engine fills, the region workers share.
  offloader KVOffloader: host tier + transfer engine + tier path, for JAX engines.
  bridge    torch (DLPack) and vLLM adapters; imports torch/vLLM lazily.

`KVOffloader` (store + transfer in one object, for JAX serving stacks) and
`GroupCaches` are loaded on first use, so `import jax_kvoffload` stays light.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["GroupCaches", "KVOffloader", "OffloaderError", "OffloaderStateError", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("KVOffloader", "OffloaderError", "OffloaderStateError"):
        from jax_kvoffload import offloader

        return getattr(offloader, name)
    if name == "GroupCaches":
        from jax_kvoffload.transfer import GroupCaches

        return GroupCaches
    raise AttributeError(f"module 'jax_kvoffload' has no attribute {name!r}")
