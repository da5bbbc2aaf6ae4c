"""The error root of jax_kvoffload: catch `KVOffloadError` for anything the library raises.

Input errors subclass `KVOffloadValueError` (a `ValueError`) or `KVOffloadTypeError` (a
`TypeError`); state errors subclass `KVOffloadStateError` (a `RuntimeError`). Each
package's own errors (config, store, transfer, tiers, bridge) derive from these.
`pallas_kernels` is standalone and keeps its own errors (`pallas_kernels.blocks.errors`).
"""

from jax_kvoffload.config.internals import KVOffloadError as KVOffloadError
from jax_kvoffload.config.internals import KVOffloadStateError as KVOffloadStateError
from jax_kvoffload.config.internals import KVOffloadTypeError as KVOffloadTypeError
from jax_kvoffload.config.internals import KVOffloadValueError as KVOffloadValueError

__all__ = ["KVOffloadError", "KVOffloadStateError", "KVOffloadTypeError", "KVOffloadValueError"]
