"""Scheduler-side host store: chunk bookkeeping, eviction policies, events, stats.

Pure Python with vLLM 0.33.0's ``CPUOffloadingManager`` semantics; it never touches
KV bytes (the transfer engine does) and imports neither jax nor torch. See
docs/store.md for the call protocol.
"""

from jax_kvoffload.config.internals import Medium as Medium

from ._access import RequestFinishedError as RequestFinishedError
from ._arc import ARCPolicy as ARCPolicy
from ._capacity import HOST_PAGE_SIZE as HOST_PAGE_SIZE
from ._capacity import CPUTierCapacity as CPUTierCapacity
from ._capacity import cpu_tier_capacity as cpu_tier_capacity
from ._context import AbstractRequestContext as AbstractRequestContext
from ._context import LookupResult as LookupResult
from ._context import RequestContext as RequestContext
from ._errors import CapacityError as CapacityError
from ._errors import DuplicatePolicyError as DuplicatePolicyError
from ._errors import KeyNotPinnedError as KeyNotPinnedError
from ._errors import KeyNotReadyError as KeyNotReadyError
from ._errors import KeyNotStoredError as KeyNotStoredError
from ._errors import PolicyContractError as PolicyContractError
from ._errors import PolicyImportError as PolicyImportError
from ._errors import StoreError as StoreError
from ._errors import StoreTypeError as StoreTypeError
from ._errors import UnknownPolicyError as UnknownPolicyError
from ._events import OffloadingEvent as OffloadingEvent
from ._keys import OffloadKey as OffloadKey
from ._keys import get_offload_block_hash as get_offload_block_hash
from ._keys import get_offload_group_idx as get_offload_group_idx
from ._keys import make_offload_key as make_offload_key
from ._lru import LRUPolicy as LRUPolicy
from ._manager import HostStore as HostStore
from ._manager import PrepareStoreOutput as PrepareStoreOutput
from ._policy_base import AbstractEvictionPolicy as AbstractEvictionPolicy
from ._policy_base import ChunkStatus as ChunkStatus
from ._policy_base import order_request_keys as order_request_keys
from ._registry import add_policy_resolver as add_policy_resolver
from ._registry import get_policy_class as get_policy_class
from ._registry import policy_names as policy_names
from ._registry import register_policy as register_policy
from ._registry import unregister_policy as unregister_policy
from ._stats import ALLOCATION_SIZE_BUCKETS as ALLOCATION_SIZE_BUCKETS
from ._stats import METRIC_NAMES as METRIC_NAMES
from ._stats import StoreCounters as StoreCounters
from ._stats import StoreStats as StoreStats

__all__ = (
    "ALLOCATION_SIZE_BUCKETS",
    "HOST_PAGE_SIZE",
    "METRIC_NAMES",
    "ARCPolicy",
    "AbstractEvictionPolicy",
    "AbstractRequestContext",
    "CPUTierCapacity",
    "CapacityError",
    "ChunkStatus",
    "DuplicatePolicyError",
    "HostStore",
    "KeyNotPinnedError",
    "KeyNotReadyError",
    "KeyNotStoredError",
    "LRUPolicy",
    "LookupResult",
    "Medium",
    "OffloadKey",
    "OffloadingEvent",
    "PolicyContractError",
    "PolicyImportError",
    "PrepareStoreOutput",
    "RequestContext",
    "RequestFinishedError",
    "StoreCounters",
    "StoreError",
    "StoreStats",
    "StoreTypeError",
    "UnknownPolicyError",
    "add_policy_resolver",
    "cpu_tier_capacity",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "get_policy_class",
    "make_offload_key",
    "order_request_keys",
    "policy_names",
    "register_policy",
    "unregister_policy",
)
