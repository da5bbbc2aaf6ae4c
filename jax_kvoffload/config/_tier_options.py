"""What every `secondary_tiers` entry may carry: the base of our tier configurations
(`TierOptions`) and the configuration of a tier only vLLM builds (`VllmTierConfig`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from jax_kvoffload.config._frozen import FrozenDict, thaw
from jax_kvoffload.config._tier_values import check_common

__all__ = ["TierOptions", "VllmTierConfig", "set_checked"]


def set_checked(obj: object, name: str, value: object) -> None:
    """Stores a checked, normalised value on a frozen configuration (in `__post_init__`)."""
    object.__setattr__(obj, name, value)


@dataclass(frozen=True, kw_only=True)
class TierOptions:
    """The base of each tier kind's configuration: the keys every entry may carry (vLLM's
    factory reads them too). A subclass is a frozen, keyword-only dataclass whose
    `__post_init__` checks its own keys (`config._tier_values`); its kind's `TierKind`
    (`config._tier_kinds`) names it.

    Attributes:
      locality: "LOCAL" or "REMOTE" (vLLM's `Locality`; picks backpressure watermarks).
      backpressure: vLLM's per-tier backpressure dict, kept verbatim.
      enable_kv_events: emit KV events for entries stored in this tier (vLLM's `fs` key).
    """

    #: For each required key (a field without a default): the example the parser's
    #: "is required" message shows.
    EXAMPLES: ClassVar[Mapping[str, str]] = {}

    locality: str | None = None
    backpressure: FrozenDict | None = None
    enable_kv_events: bool = False

    def __post_init__(self) -> None:
        where = type(self).__name__
        values = check_common(where, self.locality, self.backpressure, self.enable_kv_events)
        for name, value in zip(
            ("locality", "backpressure", "enable_kv_events"), values, strict=True
        ):
            set_checked(self, name, value)

    @property
    def type(self) -> str:
        """The `type` of this tier's `secondary_tiers` entry (its kind's name)."""
        from jax_kvoffload.config._tier_kinds import kind_of  # the registry names this class

        return kind_of(self).name

    def to_dict(self) -> dict[str, object]:
        """Our shape, `{"type": "disk", ...}`; `parse_secondary_tiers` inverts it."""
        out: dict[str, object] = {"type": self.type}
        for f in fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                out[f.name] = thaw(value)
        return out

    def to_vllm_dict(self) -> dict[str, Any]:
        """vLLM's out-of-tree shape, for `TieringOffloadingSpec`'s `secondary_tiers`
        (values as loose as vLLM's factory reads them: the bridge merges `backpressure`)."""
        from jax_kvoffload.config._tier_kinds import VLLM_MODULE, kind_of

        out = self.to_dict()
        out.update(type=kind_of(self).vllm_class, module_path=VLLM_MODULE)
        return out


@dataclass(frozen=True, kw_only=True)
class VllmTierConfig:
    """A tier only vLLM can build (its own types, or another out-of-tree class).

    Attributes:
      type: the vLLM tier type or class name.
      module_path: where vLLM imports `type` from (out-of-tree tiers).
      options: every other key of the entry, verbatim.
    """

    type: str
    module_path: str | None = None
    options: FrozenDict = field(default_factory=FrozenDict)

    def to_vllm_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.module_path is not None:
            out["module_path"] = self.module_path
        out.update(thaw(self.options))
        return out

    to_dict = to_vllm_dict
