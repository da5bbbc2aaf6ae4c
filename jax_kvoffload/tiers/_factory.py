"""Builds a tier from its typed configuration."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jax_kvoffload.config import (
    DiskTierConfig,
    RedisTierConfig,
    TierConfig,
    TierConfigError,
    VllmTierConfig,
)
from jax_kvoffload.errors import KVOffloadTypeError
from jax_kvoffload.tiers._base import SecondaryTier

__all__ = ["open_tier"]


def open_tier(
    config: TierConfig, namespace: bytes, *, describe: Mapping[str, Any] | None = None
) -> SecondaryTier:
    """The tier `config` describes, for entries of `namespace` (`namespace_digest`).

    `describe` (e.g. `namespace_fields(offloading_config)`) is written beside a disk
    tier's entries for operators. vLLM's own tier types cannot be built here.
    """
    if isinstance(config, DiskTierConfig):
        from jax_kvoffload.tiers._disk import DiskTier

        return DiskTier(config, namespace, describe=describe)
    if isinstance(config, RedisTierConfig):
        from jax_kvoffload.tiers._redis import RedisTier

        return RedisTier(config, namespace)
    if isinstance(config, VllmTierConfig):
        raise TierConfigError(
            "secondary_tiers",
            "type",
            config.type,
            "is one of vLLM's own tiers: only vLLM's TieringOffloadingSpec builds it; "
            'use "disk" or "redis" here',
        )
    raise KVOffloadTypeError(
        f"config must be a tier configuration (DiskTierConfig, RedisTierConfig), got "
        f"{type(config).__name__}"
    )
