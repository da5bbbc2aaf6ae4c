"""vLLM integration. Importing this module imports neither vLLM nor torch.

- `offloading_config_from_vllm(vllm_config, kv_cache_config)`: vLLM's own config objects
  in, our `OffloadingConfig` out, by the same rules as vLLM's `build_offloading_config`.
- `JaxOffloadingSpec`: vLLM 0.33.0's out-of-tree `OffloadingSpec` (docs/vllm.md), loaded
  by vLLM with `spec_name="JaxOffloadingSpec"` and
  `spec_module_path="jax_kvoffload.bridge.vllm"`. It, `JaxOffloadingManager` and
  `JaxOffloadingWorker` subclass vLLM's abstract classes, so they are built (and vLLM
  imported) on first attribute access. With `canonical_layout` in the extra config its
  workers store canonical host pages (docs/vllm.md, "Canonical pages"), or refuse with
  `CanonicalWorkerError`.
- `LRUPolicy`, `ARCPolicy`: our eviction policies as vLLM `CachePolicy` classes, for
  vLLM's own managers (`"eviction_policy": "LRUPolicy", "cache_policy_module_path":
  "jax_kvoffload.bridge.vllm"`); they decide exactly as vLLM's LRU and ARC.
"""

from typing import TYPE_CHECKING, Any

from jax_kvoffload.bridge._job_plan import JobSpecError as JobSpecError
from jax_kvoffload.bridge._vllm_config import convert_engine_config as convert_engine_config
from jax_kvoffload.bridge._vllm_config import (
    convert_kv_cache_config as convert_kv_cache_config,
)
from jax_kvoffload.bridge._vllm_config import convert_spec as convert_spec
from jax_kvoffload.bridge._vllm_config import (
    offloading_config_from_vllm as offloading_config_from_vllm,
)
from jax_kvoffload.bridge._vllm_pools import CanonicalWorkerError as CanonicalWorkerError
from jax_kvoffload.bridge._vllm_spec import our_offloading_config as our_offloading_config

if TYPE_CHECKING:  # built on first access by __getattr__ (they import vLLM)
    from jax_kvoffload.store import ARCPolicy, LRUPolicy

    JaxOffloadingManager: type
    JaxOffloadingSpec: type
    JaxOffloadingWorker: type

_LAZY = ("JaxOffloadingManager", "JaxOffloadingSpec", "JaxOffloadingWorker")
# Ours, declared to vLLM as `CachePolicy` classes on first access (imports vLLM).
_POLICIES = ("ARCPolicy", "LRUPolicy")

__all__ = [
    "ARCPolicy",
    "CanonicalWorkerError",
    "JaxOffloadingManager",
    "JaxOffloadingSpec",
    "JaxOffloadingWorker",
    "JobSpecError",
    "LRUPolicy",
    "convert_engine_config",
    "convert_kv_cache_config",
    "convert_spec",
    "offloading_config_from_vllm",
    "our_offloading_config",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from jax_kvoffload.bridge._vllm_spec import build_spec_classes

        return build_spec_classes()[name]
    if name in _POLICIES:
        from jax_kvoffload import store
        from jax_kvoffload.bridge._vllm_manager import install_vllm_types

        install_vllm_types()
        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
