"""The transfer package's parts shared with the rest of this library: semi-public.

`KVOffloader` (jax_kvoffload/offloader/) checks its arguments and guards its calls
with the same helpers the engine uses; it imports them from here so that no package of
ours reaches into another's private `_modules`. Stable within a release; not user API.
"""

from jax_kvoffload.transfer._caches import check_distinct as check_distinct
from jax_kvoffload.transfer._interrupts import SingleCaller as SingleCaller
from jax_kvoffload.transfer._interrupts import deferred_interrupts as deferred_interrupts

__all__ = [
    "SingleCaller",
    "check_distinct",
    "deferred_interrupts",
]
