"""Eviction-policy registry (vLLM ``CachePolicyFactory``, ``cpu/policies/factory.py``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeGuard

from ._arc import ARCPolicy
from ._errors import (
    DUPLICATE_POLICY_MESSAGE,
    UNKNOWN_POLICY_MESSAGE,
    DuplicatePolicyError,
    PolicyImportError,
    StoreTypeError,
    UnknownPolicyError,
)
from ._lru import LRUPolicy
from ._policy_base import AbstractEvictionPolicy

__all__ = [
    "add_policy_resolver",
    "get_policy_class",
    "policy_names",
    "register_policy",
    "unregister_policy",
]

PolicyResolver = Callable[[str], "type[AbstractEvictionPolicy] | None"]

# The registry: one line per built-in policy; others by `register_policy` at run time.
_POLICIES: dict[str, type[AbstractEvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}
_BUILTIN = frozenset(_POLICIES)
# Consulted, in order, for names not registered here (the vLLM bridge adds one that
# reads vLLM's CachePolicyFactory, so the store never imports vLLM itself).
_RESOLVERS: list[PolicyResolver] = []


def policy_names() -> tuple[str, ...]:
    """Returns the registered policy names, built-ins first."""
    return tuple(_POLICIES)


def _is_policy_class(cls: object) -> TypeGuard[type[AbstractEvictionPolicy]]:
    return isinstance(cls, type) and issubclass(cls, AbstractEvictionPolicy)


def register_policy(name: str, cls: type[AbstractEvictionPolicy]) -> None:
    """Registers an eviction policy class under ``name``.

    ``cls`` subclasses ``AbstractEvictionPolicy`` (or vLLM's ``CachePolicy`` once the
    vLLM bridge is in use: it registers vLLM's base as a virtual subclass of ours).

    Raises:
      StoreTypeError: if ``name`` is not a str or ``cls`` is not a policy class.
      DuplicatePolicyError: if ``name`` is already registered (vLLM's text).
    """
    if not isinstance(name, str):
        raise StoreTypeError(f"name must be a str, got {type(name).__name__}: {name!r}.")
    if not _is_policy_class(cls):
        raise StoreTypeError(
            f"cls must be a subclass of AbstractEvictionPolicy (or of vLLM's CachePolicy "
            f"with the vLLM bridge), got {cls!r}."
        )
    if name in _POLICIES:
        raise DuplicatePolicyError(DUPLICATE_POLICY_MESSAGE.format(name=name))
    _POLICIES[name] = cls


def unregister_policy(name: str) -> type[AbstractEvictionPolicy]:
    """Removes a policy registered with `register_policy` and returns its class (the
    built-in "lru" and "arc" stay).

    Raises:
      UnknownPolicyError: if ``name`` is not registered, or is a built-in.
    """
    if name in _BUILTIN or name not in _POLICIES:
        what = "a built-in policy" if name in _BUILTIN else "not registered"
        raise UnknownPolicyError(
            f"eviction policy {name!r} is {what}; registered with register_policy: "
            f"{[n for n in _POLICIES if n not in _BUILTIN]}"
        )
    return _POLICIES.pop(name)


def add_policy_resolver(resolver: PolicyResolver) -> None:
    """Adds a fallback that maps an unregistered name to a policy class, or None.

    Used by the vLLM bridge so that a policy registered with vLLM's
    ``CachePolicyFactory`` is known here too. Adding the same resolver twice is a no-op.
    """
    if not callable(resolver):
        raise StoreTypeError(f"resolver must be callable, got {resolver!r}.")
    if resolver not in _RESOLVERS:
        _RESOLVERS.append(resolver)


def _supported() -> list[str]:
    return list(_POLICIES)


def get_policy_class(name: str, module_path: str | None = None) -> type[AbstractEvictionPolicy]:
    """Resolves a policy name as vLLM does.

    A registered name wins (ours, then the resolvers', e.g. vLLM's registry through
    the bridge). Otherwise, with ``module_path``, the class called ``name`` is imported
    from that module (vLLM's ``cache_policy_module_path``).

    Raises:
      StoreTypeError: if ``name`` or ``module_path`` is not a str, or the imported
        object is not a policy class.
      UnknownPolicyError: if ``name`` is unknown and no ``module_path`` is given, or
        the module has no attribute ``name``.
      PolicyImportError: if ``module_path`` cannot be imported (an ``ImportError``).
    """
    if not isinstance(name, str):
        raise StoreTypeError(
            f"eviction_policy must be a str, got {type(name).__name__}: {name!r}; "
            f"use one of {_supported()} or a class name with cache_policy_module_path."
        )
    cls = _POLICIES.get(name)
    if cls is not None:
        return cls
    for resolver in _RESOLVERS:
        found = resolver(name)
        if found is not None:
            if not _is_policy_class(found):
                raise StoreTypeError(
                    f"eviction_policy={name!r} resolves to {found!r}, which is not a "
                    "policy class (AbstractEvictionPolicy or vLLM's CachePolicy)."
                )
            return found
    if module_path is None:
        raise UnknownPolicyError(UNKNOWN_POLICY_MESSAGE.format(name=name, supported=_supported()))
    if not isinstance(module_path, str):
        raise StoreTypeError(
            f"cache_policy_module_path must be a str (a module to import), got "
            f"{type(module_path).__name__}: {module_path!r}."
        )
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise PolicyImportError(
            f"cache_policy_module_path={module_path!r} cannot be imported ({exc}); give "
            f"an importable module that defines the class {name!r}."
        ) from exc
    found = getattr(module, name, None)
    if found is None:
        raise UnknownPolicyError(
            f"cache_policy_module_path={module_path!r} has no class named {name!r}; set "
            "eviction_policy to the class name defined in that module."
        )
    if not _is_policy_class(found):
        raise StoreTypeError(
            f"{module_path}.{name} must be a subclass of AbstractEvictionPolicy (or of "
            f"vLLM's CachePolicy with the vLLM bridge), got {found!r}."
        )
    return found
