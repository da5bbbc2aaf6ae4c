"""Eviction-policy registry (vLLM ``CachePolicyFactory``, ``cpu/policies/factory.py``)."""

from __future__ import annotations

import importlib

from ._arc import ARCPolicy
from ._errors import (
    DUPLICATE_POLICY_MESSAGE,
    UNKNOWN_POLICY_MESSAGE,
    DuplicatePolicyError,
    UnknownPolicyError,
)
from ._lru import LRUPolicy
from ._policy_base import AbstractEvictionPolicy

__all__ = ["get_policy_class", "policy_names", "register_policy"]

_POLICIES: dict[str, type[AbstractEvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def policy_names() -> tuple[str, ...]:
    """Returns the registered policy names, built-ins first."""
    return tuple(_POLICIES)


def register_policy(name: str, cls: type[AbstractEvictionPolicy]) -> None:
    """Registers an eviction policy class under ``name``.

    Raises:
      TypeError: if ``name`` is not a str or ``cls`` is not an
        ``AbstractEvictionPolicy`` subclass.
      DuplicatePolicyError: if ``name`` is already registered (vLLM's text).
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}.")
    if not (isinstance(cls, type) and issubclass(cls, AbstractEvictionPolicy)):
        raise TypeError(f"cls must be a subclass of AbstractEvictionPolicy, got {cls!r}.")
    if name in _POLICIES:
        raise DuplicatePolicyError(DUPLICATE_POLICY_MESSAGE.format(name=name))
    _POLICIES[name] = cls


def get_policy_class(name: str, module_path: str | None = None) -> type[AbstractEvictionPolicy]:
    """Resolves a policy name as vLLM does.

    A registered name wins. Otherwise, with ``module_path``, the class called ``name``
    is imported from that module (vLLM's ``cache_policy_module_path``).

    Raises:
      TypeError: if ``name`` is not a str, or the imported object is not an
        ``AbstractEvictionPolicy`` subclass.
      UnknownPolicyError: if ``name`` is unknown and no ``module_path`` is given, or
        the module has no attribute ``name``.
      ImportError: if ``module_path`` cannot be imported.
    """
    if not isinstance(name, str):
        raise TypeError(f"eviction_policy must be a str, got {type(name).__name__}.")
    cls = _POLICIES.get(name)
    if cls is not None:
        return cls
    if module_path is None:
        raise UnknownPolicyError(
            UNKNOWN_POLICY_MESSAGE.format(name=name, supported=list(_POLICIES))
        )
    module = importlib.import_module(module_path)
    found = getattr(module, name, None)
    if found is None:
        raise UnknownPolicyError(
            f"cache_policy_module_path={module_path!r} has no class named {name!r}."
        )
    if not (isinstance(found, type) and issubclass(found, AbstractEvictionPolicy)):
        raise TypeError(
            f"{module_path}.{name} must be a subclass of AbstractEvictionPolicy, got {found!r}."
        )
    return found
