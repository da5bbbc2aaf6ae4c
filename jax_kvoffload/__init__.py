"""jax_kvoffload: JAX/XLA-portable KV-cache offload for LLM serving.

Subpackages:
  config    vLLM's offloading boundary (OffloadingConfig) and its translation rules.
  store     the scheduler-side host store (chunk pool bookkeeping, eviction, events).
  transfer  the worker-side transfer engine (gather/scatter kernels + device_put).
  bridge    torch (DLPack) and vLLM adapters; imports torch/vLLM lazily.
"""

__version__ = "0.1.0"
