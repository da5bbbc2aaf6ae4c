"""`KVOffloader`: the host tier, the transfer engine and the secondary-tier path in one
object, for a JAX engine that runs scheduler and worker in one process.

The offloader owns its parts and composes them: a job book (every job id until it is
reported once), a tier path (cascades and promotions) and its accounting. It sits above
config, store, tiers, transfer and the assembly of the host tier, and below bridge, demo
and CLI (`tests/test_layering.py`). Users import `KVOffloader` from `jax_kvoffload`.
"""

from jax_kvoffload.offloader._cache_checks import (
    CacheConfigMismatchError as CacheConfigMismatchError,
)
from jax_kvoffload.offloader._cascade import PromotionMissError as PromotionMissError
from jax_kvoffload.offloader._checks import OffloaderError as OffloaderError
from jax_kvoffload.offloader._offloader import KVOffloader as KVOffloader
from jax_kvoffload.offloader._offloader import OffloaderStateError as OffloaderStateError
from jax_kvoffload.offloader._tier_stats import TierPathStats as TierPathStats

__all__ = [
    "CacheConfigMismatchError",
    "KVOffloader",
    "OffloaderError",
    "OffloaderStateError",
    "PromotionMissError",
    "TierPathStats",
]
