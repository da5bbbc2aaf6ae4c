"""The tier registry: every kind of secondary tier of ours, each declared once.

A `TierKind` says everything the library needs to know about a kind of tier: the `type`
of its `secondary_tiers` entries, its typed configuration (a `TierOptions` subclass,
whose constructor checks every key), the `SecondaryTier` subclass that opens it, and its
class name as a vLLM out-of-tree `SecondaryTierManager`. Where the bytes live (the
tier's medium, "disk" or "remote") is said by that `SecondaryTier` subclass, as every
tier must say it. The parser (`config._tiers`), the tier factory (`tiers.open_tier`),
the assembly's checks and the vLLM classes (`bridge._vllm_tiers`) are derived from this
registry; nothing else lists the kinds.

The tier class is named by an import path: this package imports nothing of ours, and
`jax_kvoffload.tiers` imports the class when the first tier of its kind is opened. A
kind registered at run time (`register_tier_kind`) may give the class itself.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from jax_kvoffload.config._errors import ConfigFieldError, ConfigTypeError
from jax_kvoffload.config._tier_disk import DiskTierConfig
from jax_kvoffload.config._tier_mooncake import MooncakeTierConfig
from jax_kvoffload.config._tier_options import TierOptions
from jax_kvoffload.config._tier_redis import RedisTierConfig

__all__ = [
    "TIER_KINDS",
    "VLLM_MODULE",
    "VLLM_TIER_TYPES",
    "TierKind",
    "kind_names_in_words",
    "kind_of",
    "register_tier_kind",
    "tier_kind",
    "tier_kind_for_vllm_class",
    "tier_kinds",
    "unregister_tier_kind",
]

# vLLM 0.33.0's registered tier types (`vllm/v1/kv_offload/tiering/factory.py`): only
# vLLM builds them, and no kind of ours may take their names.
VLLM_TIER_TYPES = ("example", "fs", "p2p", "obj", "kvcr")
# Where vLLM's factory finds our kinds' classes (`{"type": "JaxDiskTier", "module_path": ...}`).
VLLM_MODULE = "jax_kvoffload.bridge._vllm_tiers"
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@dataclass(frozen=True)
class TierKind:
    """One kind of secondary tier (see the module docstring).

    Attributes:
      name: the `type` of its `secondary_tiers` entries, e.g. "disk" (lower case).
      config: its configuration class, a frozen `TierOptions` subclass.
      tier: its `SecondaryTier` subclass, opened as `tier(config, namespace,
        describe=...)`: an import path "package.module:Class", or the class itself.
      vllm_class: its class name in `jax_kvoffload.bridge._vllm_tiers` for vLLM's
        `TieringOffloadingSpec`, e.g. "JaxDiskTier".
    """

    name: str
    config: type[TierOptions]
    tier: str | type
    vllm_class: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigFieldError(
                "TierKind.name",
                f"{self.name!r} must be a lower-case identifier like 'disk'",
            )
        ok = isinstance(self.config, type) and issubclass(self.config, TierOptions)
        if not ok or not dataclasses.is_dataclass(self.config):
            raise ConfigTypeError(
                "TierKind.config",
                f"must be a frozen dataclass subclassing TierOptions, got {self.config!r}",
            )
        if isinstance(self.tier, str) and not _PATH.match(self.tier):
            raise ConfigFieldError(
                "TierKind.tier",
                f"{self.tier!r} must be an import path like 'package.module:Class'",
            )
        if not isinstance(self.tier, (str, type)):
            raise ConfigTypeError(
                "TierKind.tier", f"must be an import path or a class, got {self.tier!r}"
            )
        if not isinstance(self.vllm_class, str) or not self.vllm_class.isidentifier():
            raise ConfigFieldError(
                "TierKind.vllm_class",
                f"{self.vllm_class!r} must be a class name like 'JaxDiskTier'",
            )


# The registry: one line per kind.
TIER_KINDS = (
    TierKind("disk", DiskTierConfig, "jax_kvoffload.tiers._disk:DiskTier", "JaxDiskTier"),
    TierKind("redis", RedisTierConfig, "jax_kvoffload.tiers._redis:RedisTier", "JaxRedisTier"),
    TierKind(
        "mooncake",
        MooncakeTierConfig,
        "jax_kvoffload.tiers._mooncake:MooncakeTier",
        "JaxMooncakeTier",
    ),
)

_kinds: dict[str, TierKind] = {}


def register_tier_kind(kind: TierKind) -> TierKind:
    """Adds `kind` to the registry (its parser, factory and vLLM class follow); returns it.
    Register at import time, before tiers are parsed or opened: the registry takes no
    lock.

    Raises:
      ConfigFieldError: its name, its vLLM class name or its configuration class is
        already another kind's (or its name is one of vLLM's own tier types).
    """
    if not isinstance(kind, TierKind):
        raise ConfigTypeError("kind", f"must be a TierKind, got {type(kind).__name__}")
    if kind.name in VLLM_TIER_TYPES:
        raise ConfigFieldError(
            "TierKind.name", f"{kind.name!r} is one of vLLM's own tier types; pick another"
        )
    for other in _kinds.values():
        for what in ("name", "vllm_class", "config"):
            if getattr(other, what) == getattr(kind, what):
                raise ConfigFieldError(
                    f"TierKind.{what}",
                    f"{getattr(kind, what)!r} is already the {what} of the tier kind "
                    f"{other.name!r}; unregister_tier_kind({other.name!r}) first",
                )
    _kinds[kind.name] = kind
    return kind


def unregister_tier_kind(name: str) -> TierKind:
    """Removes the kind named `name` from the registry and returns it."""
    try:
        return _kinds.pop(name)
    except KeyError:
        raise ConfigFieldError(
            "name", f"{name!r} is no registered tier kind; registered: {sorted(_kinds)}"
        ) from None


def tier_kinds() -> tuple[TierKind, ...]:
    """The registered kinds, in registration order."""
    return tuple(_kinds.values())


def tier_kind(name: str) -> TierKind | None:
    """The kind whose entries have `type` `name`, or None."""
    return _kinds.get(name) if isinstance(name, str) else None


def tier_kind_for_vllm_class(vllm_class: str) -> TierKind | None:
    """The kind whose vLLM class is named `vllm_class`, or None."""
    return next((k for k in _kinds.values() if k.vllm_class == vllm_class), None)


def kind_of(config: TierOptions) -> TierKind:
    """The kind `config` configures (by its exact class)."""
    kind = next((k for k in _kinds.values() if k.config is type(config)), None)
    if kind is None:
        raise ConfigTypeError(
            "config",
            f"{type(config).__name__} is the configuration of no registered tier kind "
            f"(registered: {', '.join(k.config.__name__ for k in _kinds.values())}); "
            "register_tier_kind(TierKind(...)) first",
        )
    return kind


def kind_names_in_words(conjunction: str) -> str:
    """The registered kinds' names for a message: '"disk" or "redis"'."""
    names = [f'"{k.name}"' for k in _kinds.values()] or ["none"]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {conjunction} {names[-1]}"


for _kind in TIER_KINDS:
    register_tier_kind(_kind)
