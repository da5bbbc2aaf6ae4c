"""The host tier's keys of `kv_connector_extra_config`, parsed once into `HostTierConfig`.

vLLM 0.33.0's `CPUOffloadingSpec` and `TieringOffloadingSpec` read these keys from the
extra config (`vllm/v1/kv_offload/cpu/spec.py`, `tiering/spec.py`); `KVOffloader` and
`JaxOffloadingSpec` read them here, with vLLM's rules (`int(...)` for integers, so a
decimal string is fine; a threshold below 2 is off; a negative tracker size tracks
nothing) and errors that name the key, the value and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from jax_kvoffload.config._errors import ConfigFieldError, ConfigTypeError
from jax_kvoffload.config._frozen import FrozenDict
from jax_kvoffload.config._tiers import TierConfig, parse_secondary_tiers

__all__ = ["CACHE_LAYOUTS", "HOST_POOLS", "HostTierConfig", "StoreKwargs", "host_tier_config"]

#: Host pool implementations: "numpy" (rows allocated once; a host copy per store) or
#: "pinned" (the host arrays `jax.device_put` returns are the rows; JAX engines only).
HOST_POOLS = ("auto", "numpy", "pinned")

#: Names of the device cache layouts a JAX engine may declare with the `cache_layout`
#: key (`pallas_kernels.LAYOUT_NAMES`; config imports nothing of ours, a test keeps the
#: two equal): "rpa" is the ragged-paged-attention v3 cache of tpu-inference,
#: sglang-jax and EasyDeL, `[num_blocks, block_size, kv_rows, packing, head_dim]`.
CACHE_LAYOUTS = (
    "nhd", "nhd_separate", "nhd_first", "nhd_second",
    "hnd", "hnd_separate", "hnd_first", "hnd_second",
    "mla", "raw", "rpa",
)  # fmt: skip

# vLLM's default pause between tier-poll rounds (`tiering/manager.py`).
DEFAULT_TIER_POLL_INTERVAL_S = 0.001

_KEY = "kv_connector_extra_config[{!r}]"


class StoreKwargs(TypedDict):
    """The `HostStore` keyword arguments of a host tier (`HostTierConfig.store_kwargs`)."""

    eviction_policy: str
    cache_policy_module_path: str | None
    store_threshold: int
    max_tracker_size: int


@dataclass(frozen=True, kw_only=True)
class HostTierConfig:
    """The host tier and what sits behind it, as the extra config describes them.

    Attributes:
      cpu_bytes_to_use: host bytes for the chunk rows (vLLM's required key), None when
        absent; sized into chunks by `jax_kvoffload.store.cpu_tier_capacity`.
      eviction_policy: "lru", "arc", a policy registered with our registry or vLLM's
        `CachePolicyFactory`, or a class name with `cache_policy_module_path`.
      cache_policy_module_path: module to import an out-of-tree policy from.
      store_threshold: offers before a key is stored (vLLM: values below 2 are off).
      max_tracker_size: keys the reuse tracker counts (threshold >= 2 only; >= 0).
      secondary_tiers: the typed `secondary_tiers` list (docs/tiers.md).
      backpressure: vLLM's top-level default for each tier's backpressure detector
        (used where vLLM's tiering manager drives the tiers), verbatim.
      tier_poll_interval_s: vLLM's pause between tier-poll rounds (its manager's key).
      host_pool: "auto" (the default: "pinned" for caches on an accelerator, "numpy"
        on CPU), "numpy" or "pinned" (`HOST_POOLS`; ours, JAX engines).
      cache_layout: the device caches' layout name (`CACHE_LAYOUTS`; ours, JAX engines),
        None when absent: `KVOffloader` then takes `GroupCaches` that name it.
    """

    cpu_bytes_to_use: int | None = None
    eviction_policy: str = "lru"
    cache_policy_module_path: str | None = None
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    secondary_tiers: tuple[TierConfig, ...] = ()
    backpressure: FrozenDict | None = None
    tier_poll_interval_s: float = DEFAULT_TIER_POLL_INTERVAL_S
    host_pool: str = "auto"
    cache_layout: str | None = None

    #: Keys vLLM reads only when it builds the manager (`get_manager`), so their errors
    #: surface there too (`JaxOffloadingSpec` defers them).
    MANAGER_KEYS = ("eviction_policy", "cache_policy_module_path", "store_threshold",
                    "max_tracker_size")  # fmt: skip

    def store_kwargs(self) -> StoreKwargs:
        """`HostStore` keyword arguments (a threshold below 2 and a negative tracker size
        as vLLM treats them: off, and tracking nothing)."""
        return {
            "eviction_policy": self.eviction_policy,
            "cache_policy_module_path": self.cache_policy_module_path,
            "store_threshold": self.store_threshold if self.store_threshold >= 2 else 0,
            "max_tracker_size": max(self.max_tracker_size, 0),
        }


def _int(key: str, value: Any, *, strict: bool = False) -> int:
    """`int(value)` as vLLM reads the key (a float truncates, as there); `strict` also
    refuses bools and floats (a byte budget is never truncated)."""
    # `value` stays Any: `int()` itself decides what converts (its TypeError is the check).
    where = _KEY.format(key)
    if strict and (isinstance(value, bool) or not isinstance(value, (int, str))):
        raise ConfigTypeError(
            where,
            f"must be an integer (or a decimal string), got {type(value).__name__}: {value!r}",
        )
    try:
        return int(value)
    except TypeError:
        raise ConfigTypeError(
            where,
            f"must be an integer (or a decimal string), got {type(value).__name__}: {value!r}",
        ) from None
    except (ValueError, OverflowError):
        raise ConfigFieldError(where, f"{value!r} is not an integer; e.g. {{{key!r}: 2}}") from None


def _str(key: str, value: object, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigTypeError(
            _KEY.format(key), f"must be a non-empty string, got {type(value).__name__}: {value!r}"
        )
    return value


def host_tier_config(
    extra_config: Mapping[str, Any],
    *,
    cpu_bytes_to_use: int | str | None = None,
    eviction_policy: str | None = None,
    host_pool: str | None = None,
) -> HostTierConfig:
    """The host-tier keys of `extra_config`, typed; keyword arguments win over keys.

    Raises `ConfigFieldError` / `ConfigTypeError` naming the key for a bad value and
    `TierConfigError` for a bad `secondary_tiers` entry. Other keys are left alone
    (the boundary's own, and whatever vLLM or other specs read).
    """
    if not isinstance(extra_config, Mapping):
        raise ConfigTypeError(
            "kv_connector_extra_config", f"must be a dict, got {type(extra_config).__name__}"
        )
    get = extra_config.get
    budget = cpu_bytes_to_use if cpu_bytes_to_use is not None else get("cpu_bytes_to_use")
    kw: dict[str, Any] = {
        "cpu_bytes_to_use": (
            None if budget is None else _int("cpu_bytes_to_use", budget, strict=True)
        ),
        "eviction_policy": _str(
            "eviction_policy", eviction_policy or get("eviction_policy", "lru")
        ),
        "cache_policy_module_path": _str(
            "cache_policy_module_path", get("cache_policy_module_path"), optional=True
        ),
        "store_threshold": _int("store_threshold", get("store_threshold", 0)),
        "max_tracker_size": _int("max_tracker_size", get("max_tracker_size", 64_000)),
        "secondary_tiers": parse_secondary_tiers(get("secondary_tiers")),
    }
    bp = get("backpressure")
    if bp is not None and not isinstance(bp, Mapping):
        raise ConfigTypeError(
            _KEY.format("backpressure"), f"must be a dict (vLLM's shape), got {bp!r}"
        )
    kw["backpressure"] = None if bp is None else FrozenDict(bp)
    poll = get("tier_poll_interval_s", DEFAULT_TIER_POLL_INTERVAL_S)
    try:
        kw["tier_poll_interval_s"] = float(poll)  # vLLM's float(...); <= 0 turns polling off
    except (TypeError, ValueError):
        raise ConfigFieldError(
            _KEY.format("tier_poll_interval_s"), f"{poll!r} is not a number of seconds"
        ) from None
    if math.isnan(kw["tier_poll_interval_s"]):
        raise ConfigFieldError(_KEY.format("tier_poll_interval_s"), "must not be NaN")
    pool = host_pool if host_pool is not None else get("host_pool", "auto")
    if not isinstance(pool, str):  # (an array's `in` would raise numpy's own error)
        raise ConfigTypeError(
            _KEY.format("host_pool"),
            f"must be a pool name, one of {HOST_POOLS}, got {type(pool).__name__} (the "
            "offloader builds its pool; a TransferEngine takes a HostPool object)",
        )
    if pool not in HOST_POOLS:
        raise ConfigFieldError(
            _KEY.format("host_pool"), f"{pool!r} is not a host pool; use one of {HOST_POOLS}"
        )
    kw["host_pool"] = pool
    layout = get("cache_layout")
    if layout is not None and (not isinstance(layout, str) or layout.lower() not in CACHE_LAYOUTS):
        raise ConfigFieldError(
            _KEY.format("cache_layout"),
            f"{layout!r} is not a cache layout; use one of {CACHE_LAYOUTS} (e.g. 'rpa' for "
            "ragged-paged-attention v3 caches)",
        )
    kw["cache_layout"] = None if layout is None else layout.lower()
    return HostTierConfig(**kw)
