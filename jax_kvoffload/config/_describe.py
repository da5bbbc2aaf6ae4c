"""Engine and KV cache descriptions from plain JSON-like data, with errors naming the path.

Format (every key is the dataclass field of the same name; specs carry a "type"):

    {"engine": {"model_config": {...}, "cache_config": {...}, "parallel_config": {...},
                "kv_transfer_config": {...}, "kv_events_config": {...},
                "use_v2_model_runner": false},
     "kv_cache": {"num_blocks": 1024, "kv_cache_tensors": [...],
                  "kv_cache_groups": [{"layer_names": [...],
                                       "kv_cache_spec": {"type": "FullAttentionSpec", ...}}]}}
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

from jax_kvoffload.config import _specs
from jax_kvoffload.config._engine import (
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
)
from jax_kvoffload.config._errors import ConfigFieldError
from jax_kvoffload.config._kv_cache import (
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheTensor,
)

SPEC_TYPES: dict[str, type[_specs.KVCacheSpec]] = {
    cls.__name__: cls
    for cls in vars(_specs).values()
    if isinstance(cls, type)
    and issubclass(cls, _specs.KVCacheSpec)
    and not cls.__name__.startswith("_")
    and cls not in (_specs.KVCacheSpec, _specs.AttentionSpec)
}


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _build(cls: type, data: Any, path: str, convert: dict[str, Any] | None = None) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigFieldError(path, f"expected an object, got {type(data).__name__}")
    known = _fields(cls)
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigFieldError(path, f"unknown keys {unknown}; known: {sorted(known)}")
    kwargs = {}
    for name, value in data.items():
        where = f"{path}.{name}"
        if convert and name in convert:
            value = convert[name](value, where)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigFieldError as exc:
        raise ConfigFieldError(f"{path}.{exc.field}", str(exc).split(": ", 1)[1]) from None
    except TypeError as exc:
        raise ConfigFieldError(path, str(exc)) from None


def _tuple(value: Any, path: str) -> tuple:
    if not isinstance(value, list):
        raise ConfigFieldError(path, f"expected a list, got {type(value).__name__}")
    return tuple(value)


def _ratio(value: Any, path: str) -> Any:
    # JSON has no fractions: "1/2" is accepted for tokens_per_state.
    if isinstance(value, str):
        try:
            return Fraction(value)
        except ValueError:
            raise ConfigFieldError(path, f"expected an int or 'p/q', got {value!r}") from None
    return value


def spec_from_dict(data: Any, path: str = "kv_cache_spec") -> _specs.KVCacheSpec:
    if not isinstance(data, Mapping) or "type" not in data:
        raise ConfigFieldError(path, f'needs a "type", one of {sorted(SPEC_TYPES)}')
    kind = data["type"]
    cls = SPEC_TYPES.get(kind)
    if cls is None:
        raise ConfigFieldError(
            f"{path}.type", f"unknown spec {kind!r}; use one of {sorted(SPEC_TYPES)}"
        )
    body = {k: v for k, v in data.items() if k != "type"}
    return _build(
        cls,
        body,
        path,
        {
            "shapes": lambda v, p: tuple(_tuple(s, p) for s in _tuple(v, p)),
            "dtypes": _tuple,
            "tokens_per_state": _ratio,
            "kv_cache_specs": lambda v, p: {
                name: spec_from_dict(inner, f"{p}.{name}")
                for name, inner in (v.items() if isinstance(v, Mapping) else [])
            },
        },
    )


def kv_cache_config_from_dict(data: Any, path: str = "kv_cache") -> KVCacheConfig:
    def tensors(value: Any, where: str) -> tuple:
        return tuple(
            _build(KVCacheTensor, t, f"{where}[{i}]", {"layers": _tuple})
            for i, t in enumerate(_tuple(value, where))
        )

    def groups(value: Any, where: str) -> tuple:
        return tuple(
            _build(
                KVCacheGroupSpec,
                g,
                f"{where}[{i}]",
                {
                    "layer_names": _tuple,
                    "kv_cache_spec": spec_from_dict,
                    "role": lambda v, p: _role(v, p),
                },
            )
            for i, g in enumerate(_tuple(value, where))
        )

    return _build(
        KVCacheConfig, data, path, {"kv_cache_tensors": tensors, "kv_cache_groups": groups}
    )


def _role(value: Any, path: str) -> KVCacheGroupRole:
    try:
        return KVCacheGroupRole(value)
    except ValueError:
        roles = [r.value for r in KVCacheGroupRole]
        raise ConfigFieldError(path, f"unknown role {value!r}; use one of {roles}") from None


def engine_config_from_dict(data: Any, path: str = "engine") -> EngineConfig:
    sub = {
        "model_config": lambda v, p: _build(ModelConfig, v, p),
        "cache_config": lambda v, p: _build(CacheConfig, v, p),
        "parallel_config": lambda v, p: _build(ParallelConfig, v, p),
        "kv_transfer_config": lambda v, p: None if v is None else _build(KVTransferConfig, v, p),
        "kv_events_config": lambda v, p: None if v is None else _build(KVEventsConfig, v, p),
    }
    if isinstance(data, Mapping) and "model_config" not in data:
        raise ConfigFieldError(path, "missing keys ['model_config']")
    return _build(EngineConfig, data, path, sub)


def load_description(path: str | Path) -> tuple[EngineConfig, KVCacheConfig]:
    """Reads `{"engine": ..., "kv_cache": ...}` from a JSON file."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ConfigFieldError(str(path), f"not valid JSON: {exc}") from None
    if not isinstance(data, Mapping):
        raise ConfigFieldError(str(path), "expected an object with 'engine' and 'kv_cache'")
    missing = sorted({"engine", "kv_cache"} - set(data))
    if missing:
        raise ConfigFieldError(str(path), f"missing keys {missing}")
    return engine_config_from_dict(data["engine"]), kv_cache_config_from_dict(data["kv_cache"])
