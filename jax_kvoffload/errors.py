"""The error root of jax_kvoffload: catch `KVOffloadError` for anything the library raises.

Input errors subclass `KVOffloadValueError` (a `ValueError`) or `KVOffloadTypeError` (a
`TypeError`); state errors subclass `KVOffloadStateError` (a `RuntimeError`). A call its
signature refuses (an unknown keyword on a public constructor, a missing argument) is a
`SignatureError` (a `KVOffloadTypeError`). Each package's own errors (config, store,
transfer, tiers, bridge) derive from these. `pallas_kernels` is standalone and keeps its
own errors (`pallas_kernels.blocks.errors`). The list, with what each means: docs/errors.md.
"""

from jax_kvoffload.config.internals import KVOffloadError as KVOffloadError
from jax_kvoffload.config.internals import KVOffloadStateError as KVOffloadStateError
from jax_kvoffload.config.internals import KVOffloadTypeError as KVOffloadTypeError
from jax_kvoffload.config.internals import KVOffloadValueError as KVOffloadValueError
from jax_kvoffload.config.internals import SignatureError as SignatureError

__all__ = [
    "KVOffloadError",
    "KVOffloadStateError",
    "KVOffloadTypeError",
    "KVOffloadValueError",
    "SignatureError",
]
