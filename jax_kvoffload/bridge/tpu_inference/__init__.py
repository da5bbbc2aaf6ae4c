"""tpu-inference (vLLM's JAX/TPU backend) integration: its offload connector on our store.

vLLM-TPU loads `TPUOffloadConnector` (one of the class names its platform admits) from
this module:

    --kv-transfer-config '{"kv_connector": "TPUOffloadConnector",
                           "kv_connector_module_path": "jax_kvoffload.bridge.tpu_inference",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"secondary_tiers": [...]}}'

It keeps tpu-inference 0.32.0's scheduler (`TPUOffloadConnectorScheduler`, its
metadata and stats types) and runner contract (`register_runner`), and puts our
`HostStore` (as their scheduler's `offload_manager`), our transfer engine and kernels
(the worker) and our secondary tiers (disk, Redis, ...; entries keyed by the engine's
block hashes) behind it. docs/tpu_inference.md says what it depends on of theirs.

Importing this module imports neither vLLM nor tpu-inference: the classes subclass
theirs and are built on first attribute access.
"""

from typing import TYPE_CHECKING, Any

from jax_kvoffload.bridge.tpu_inference._errors import (
    TPUConnectorConfigError as TPUConnectorConfigError,
)
from jax_kvoffload.bridge.tpu_inference._errors import (
    TPUConnectorStateError as TPUConnectorStateError,
)
from jax_kvoffload.bridge.tpu_inference._errors import (
    UnknownChunkError as UnknownChunkError,
)

if TYPE_CHECKING:
    JaxStoreScheduler: type
    TPUOffloadConnector: type

_LAZY = ("JaxStoreScheduler", "TPUOffloadConnector")

__all__ = [
    "JaxStoreScheduler",
    "TPUConnectorConfigError",
    "TPUConnectorStateError",
    "TPUOffloadConnector",
    "UnknownChunkError",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from jax_kvoffload.bridge.tpu_inference._classes import build_classes

        return build_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
