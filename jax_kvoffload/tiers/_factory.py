"""Opens a tier from its typed configuration, through the tier registry."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

from jax_kvoffload.config import TierConfig, TierConfigError, VllmTierConfig
from jax_kvoffload.config.internals import TierKind, kind_names_in_words, tier_kinds
from jax_kvoffload.errors import KVOffloadTypeError
from jax_kvoffload.tiers._base import SecondaryTier

__all__ = ["open_tier", "tier_class"]


def tier_class(kind: TierKind) -> type[SecondaryTier]:
    """The `SecondaryTier` subclass `kind` names (imported on first use)."""
    cls = kind.tier
    if isinstance(cls, str):
        module, _, name = cls.partition(":")
        cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, SecondaryTier)):
        raise KVOffloadTypeError(
            f"TierKind {kind.name!r}: tier={kind.tier!r} must name a SecondaryTier subclass, "
            f"got {cls!r}"
        )
    return cls


def open_tier(
    config: TierConfig, namespace: bytes, *, describe: Mapping[str, object] | None = None
) -> SecondaryTier:
    """The tier `config` describes, for entries of `namespace` (`namespace_digest`).

    `describe` (e.g. `namespace_fields(offloading_config)`) is written beside a disk
    tier's entries for operators. vLLM's own tier types cannot be built here.
    """
    if isinstance(config, VllmTierConfig):
        raise TierConfigError(
            "secondary_tiers",
            "type",
            config.type,
            "is one of vLLM's own tiers: only vLLM's TieringOffloadingSpec builds it; "
            f"use {kind_names_in_words('or')} here",
        )
    kind = next((k for k in tier_kinds() if k.config is type(config)), None)
    if kind is None:
        raise KVOffloadTypeError(
            "config must be a tier configuration "
            f"({', '.join(k.config.__name__ for k in tier_kinds())}), got "
            f"{type(config).__name__}"
        )
    # Every kind's class opens as (config, namespace, describe=...): the registry's rule.
    opener: Callable[..., SecondaryTier] = tier_class(kind)
    return opener(config, namespace, describe=describe)
