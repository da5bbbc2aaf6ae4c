"""Secondary-tier configuration: vLLM 0.33.0's `secondary_tiers` extra-config key, typed.

vLLM's `TieringOffloadingSpec` reads `kv_connector_extra_config["secondary_tiers"]`: a
list of dicts, each with a `type` (a registered tier, or a class name paired with
`module_path`), an optional `backpressure` dict (consumed by vLLM's factory), an
optional `locality` and tier-specific keyword arguments. The same list is parsed here,
once, into frozen dataclasses:

- the `type` of a kind of ours (the registry, `config._tier_kinds`: `{"type": "disk",
  ...}` -> `DiskTierConfig`, `{"type": "redis", ...}` -> `RedisTierConfig`) -> its
  configuration class; also reached as vLLM out-of-tree tiers (`{"type": "JaxDiskTier",
  "module_path": "jax_kvoffload.bridge._vllm_tiers", ...}`) with the same options;
- vLLM's own tiers (`example`, `fs`, `p2p`, `obj`, `kvcr`) and other out-of-tree classes
  -> `VllmTierConfig`, kept verbatim: only vLLM can build them.

Every error is a `TierConfigError` naming the entry, the key, the value and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from typing import Any, cast

from jax_kvoffload.config._frozen import FrozenDict
from jax_kvoffload.config._tier_kinds import (
    VLLM_TIER_TYPES,
    tier_kind,
    tier_kind_for_vllm_class,
    tier_kinds,
)
from jax_kvoffload.config._tier_options import TierOptions, VllmTierConfig
from jax_kvoffload.config._tier_values import ABSENT, TierConfigError

__all__ = [
    "TierConfig",
    "parse_secondary_tiers",
    "secondary_tiers_from_extra_config",
    "tier_config_from_dict",
]

TierConfig = TierOptions | VllmTierConfig


def _unknown(where: str, raw: Mapping[str, object], cls: type) -> None:
    known = sorted({f.name for f in dataclasses.fields(cls)} | {"type", "module_path"})
    for key in raw:
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known keys: {known}"
        raise TierConfigError(where, str(key), raw[key], f"unknown key; {hint}")


def _build(where: str, cls: type[TierOptions], raw: dict[str, Any]) -> TierOptions:
    """`cls(**raw)` after the structural checks (required keys present, none unknown);
    the constructor checks every value (`__post_init__`), its errors reported at `where`."""
    fields = dataclasses.fields(cls)
    for f in fields:
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in raw:
            example = cls.EXAMPLES.get(f.name, f'"{f.name}": ...')
            raise TierConfigError(where, f.name, ABSENT, f"is required, e.g. {example}")
    known = {f.name for f in fields}
    _unknown(where, {k: v for k, v in raw.items() if k not in known}, cls)
    try:
        return cls(**raw)
    except TierConfigError as e:
        raise e.relocated(where) from None


def tier_config_from_dict(entry: object, where: str = "secondary_tiers[0]") -> TierConfig:
    """One `secondary_tiers` entry, typed (see the module docstring for the shapes)."""
    if not isinstance(entry, Mapping):
        raise TierConfigError(
            where, None, entry, 'must be a dict like {"type": "disk", "path": ..., ...}'
        )
    raw = dict(entry)
    tier_type = raw.pop("type", None)
    module_path = raw.pop("module_path", None)
    ours = sorted(k.name for k in tier_kinds())
    if not isinstance(tier_type, str) or not tier_type:
        raise TierConfigError(
            where,
            "type",
            tier_type if "type" in entry else ABSENT,
            f"is required: one of {ours} (ours), {list(VLLM_TIER_TYPES)} "
            "(vLLM's), or a class name with module_path",
        )
    if module_path is not None and not isinstance(module_path, str):
        raise TierConfigError(where, "module_path", module_path, "must be a module path string")
    kind = tier_kind_for_vllm_class(tier_type) if module_path else None
    if kind is not None and cast(str, module_path).startswith("jax_kvoffload."):
        return _build(where, kind.config, raw)
    kind = tier_kind(tier_type)
    if kind is not None:
        if module_path is not None:
            raise TierConfigError(
                where,
                "module_path",
                module_path,
                f'is not used with type "{tier_type}"; remove it, or use type "{kind.vllm_class}"',
            )
        return _build(where, kind.config, raw)
    if tier_type not in VLLM_TIER_TYPES and module_path is None:
        close = difflib.get_close_matches(tier_type, [*ours, *VLLM_TIER_TYPES], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TierConfigError(
            where,
            "type",
            tier_type,
            f"unknown tier type; {hint}ours: {ours}, vLLM's: "
            f"{list(VLLM_TIER_TYPES)}; an out-of-tree class also needs module_path",
        )
    return VllmTierConfig(type=tier_type, module_path=module_path, options=FrozenDict(raw))


def parse_secondary_tiers(value: object, where: str = "secondary_tiers") -> tuple[TierConfig, ...]:
    """The typed tiers of a `secondary_tiers` value (None or a list of dicts)."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise TierConfigError(
            where,
            None,
            value,
            "must be a list of tier configurations (vLLM's rule); "
            'wrap one tier in a list: [{"type": "disk", ...}]',
        )
    return tuple(tier_config_from_dict(e, f"{where}[{i}]") for i, e in enumerate(value))


def secondary_tiers_from_extra_config(extra_config: Mapping[str, object]) -> tuple[TierConfig, ...]:
    """`parse_secondary_tiers(extra_config.get("secondary_tiers"))`."""
    return parse_secondary_tiers(extra_config.get("secondary_tiers"))
