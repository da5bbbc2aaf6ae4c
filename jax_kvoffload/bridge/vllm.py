"""vLLM integration. Importing this module imports neither vLLM nor torch.

- `offloading_config_from_vllm(vllm_config, kv_cache_config)`: vLLM's own config objects
  in, our `OffloadingConfig` out, by the same rules as vLLM's `build_offloading_config`.
"""

from jax_kvoffload.bridge._vllm_config import convert_engine_config as convert_engine_config
from jax_kvoffload.bridge._vllm_config import (
    convert_kv_cache_config as convert_kv_cache_config,
)
from jax_kvoffload.bridge._vllm_config import convert_spec as convert_spec
from jax_kvoffload.bridge._vllm_config import (
    offloading_config_from_vllm as offloading_config_from_vllm,
)

__all__ = [
    "convert_engine_config",
    "convert_kv_cache_config",
    "convert_spec",
    "offloading_config_from_vllm",
]
