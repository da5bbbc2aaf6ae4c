"""Exceptions raised by the host store.

Every store error derives from the library root (``jax_kvoffload.errors``): a wrong
value is a ``StoreError`` (a ``KVOffloadValueError``, so a ``ValueError``): a key, a
budget, a policy name that breaks a rule of the manager's call protocol; a wrong type
is a ``StoreTypeError`` (a ``KVOffloadTypeError``, so a ``TypeError``). Messages name
the parameter, show the value and give the fix. Where vLLM 0.33.0 asserts, the message
starts with vLLM's wording so logs read the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jax_kvoffload.errors import (
    KVOffloadError,
    KVOffloadStateError,
    KVOffloadTypeError,
    KVOffloadValueError,
)

if TYPE_CHECKING:
    from ._keys import OffloadKey

__all__ = [
    "CapacityError",
    "DuplicatePolicyError",
    "KeyNotPinnedError",
    "KeyNotReadyError",
    "KeyNotStoredError",
    "PolicyContractError",
    "PolicyImportError",
    "StoreError",
    "StoreTypeError",
    "UnknownPolicyError",
]


class StoreError(KVOffloadValueError):
    """Base class of every error the host store raises on a wrong value."""


class StoreTypeError(KVOffloadTypeError):
    """An argument of a store call has the wrong type (a key that is not bytes, ...)."""


class KeyNotStoredError(StoreError):
    """A key passed to ``prepare_load`` or ``complete_load`` is not in the store.

    vLLM asserts "Chunk <key> not found in cache"; the message keeps that text.
    `key` is the key refused (set where `prepare_load` refuses it).
    """

    key: OffloadKey | None = None


class KeyNotReadyError(StoreError):
    """A key passed to ``prepare_load`` is present but its store has not completed.

    ``lookup`` reports such a key as ``LookupResult.HIT_PENDING``; load it only after
    ``complete_store(keys, success=True)``. `key` is the key refused.
    """

    key: OffloadKey | None = None


class KeyNotPinnedError(StoreError):
    """``complete_load`` was called for a key with no load in flight (ref count 0)."""


class PolicyContractError(KVOffloadStateError):
    """An eviction policy broke its contract (e.g. ``evict(n)`` returned m != n chunks).

    A bug in the policy, not in the caller's input; the store's state is unchanged.
    """


class CapacityError(StoreError):
    """The host-tier byte budget (``cpu_bytes_to_use``) or chunk size is invalid."""


class UnknownPolicyError(StoreError):
    """The eviction policy name is neither built in nor registered."""


class PolicyImportError(KVOffloadError, ImportError):
    """``cache_policy_module_path`` cannot be imported (an ``ImportError``, as in vLLM)."""


class DuplicatePolicyError(StoreError):
    """A policy name was registered twice."""


# vLLM 0.33.0's texts, kept verbatim (``vllm/v1/kv_offload/cpu/spec.py`` and
# ``cpu/policies/``) so logs and tests match.
MISSING_BUDGET_MESSAGE = "cpu_bytes_to_use must be specified in kv_connector_extra_config"
UNKNOWN_POLICY_MESSAGE = (
    "Unknown cache policy: {name!r}. Supported: {supported}. "
    "For an out-of-tree policy, also set cache_policy_module_path."
)
DUPLICATE_POLICY_MESSAGE = "Cache policy {name!r} is already registered."
