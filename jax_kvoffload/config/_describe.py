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
from collections.abc import Callable, Mapping
from fractions import Fraction
from pathlib import Path
from typing import TypeVar

from jax_kvoffload.config import _specs
from jax_kvoffload.config._engine import (
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
)
from jax_kvoffload.config._errors import ConfigFieldError, ConfigTypeError
from jax_kvoffload.config._kv_cache import (
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from jax_kvoffload.config._validate import show

SPEC_TYPES: dict[str, type[_specs.KVCacheSpec]] = {
    cls.__name__: cls
    for cls in vars(_specs).values()
    if isinstance(cls, type)
    and issubclass(cls, _specs.KVCacheSpec)
    and not cls.__name__.startswith("_")
    and cls not in (_specs.KVCacheSpec, _specs.AttentionSpec)
}


_T = TypeVar("_T")
# A key's converter: the raw JSON value and its path in, the field's value out.
_Convert = Callable[[object, str], object]


def _fields(cls: type) -> dict[str, dataclasses.Field[object]]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _build(
    cls: type[_T], data: object, path: str, convert: dict[str, _Convert] | None = None
) -> _T:
    if not isinstance(data, Mapping):
        raise ConfigFieldError(path, f"expected an object, got {_json_type(data)}")
    known = _fields(cls)
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigFieldError(path, f"unknown keys {unknown}; use only {sorted(known)}")
    missing = sorted(
        name
        for name, f in known.items()
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and name not in data
    )
    if missing:
        raise ConfigFieldError(path, f"missing keys {missing}; add them")
    kwargs = {}
    for name, value in data.items():
        where = f"{path}.{name}"
        if convert and name in convert:
            value = convert[name](value, where)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except (ConfigFieldError, ConfigTypeError) as exc:
        message = str(exc).split(": ", 1)[1]
        raise type(exc)(f"{path}.{exc.field}", message) from None


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number")


def _tuple(value: object, path: str) -> tuple[object, ...]:
    if not isinstance(value, list):
        raise ConfigFieldError(path, f"expected a list, got {_json_type(value)}")
    return tuple(value)


def _ratio(value: object, path: str) -> object:
    # JSON has no fractions: "1/2" is accepted for tokens_per_state.
    if isinstance(value, str):
        try:
            return Fraction(value)
        except ValueError:
            raise ConfigFieldError(
                path, f"expected an int or a fraction such as '1/2', got {show(value)}"
            ) from None
    return value


def spec_from_dict(data: object, path: str = "kv_cache_spec") -> _specs.KVCacheSpec:
    if not isinstance(data, Mapping) or "type" not in data:
        raise ConfigFieldError(path, f'needs a "type", one of {sorted(SPEC_TYPES)}')
    kind = data["type"]
    cls = SPEC_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ConfigFieldError(
            f"{path}.type", f"unknown spec {show(kind)}; use one of {sorted(SPEC_TYPES)}"
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
            "kv_cache_specs": _layer_specs,
        },
    )


def _layer_specs(value: object, path: str) -> dict[str, _specs.KVCacheSpec]:
    if not isinstance(value, Mapping):
        raise ConfigFieldError(
            path, f"expected an object of layer -> spec, got {_json_type(value)}"
        )
    return {name: spec_from_dict(inner, f"{path}.{name}") for name, inner in value.items()}


def kv_cache_config_from_dict(data: object, path: str = "kv_cache") -> KVCacheConfig:
    def tensors(value: object, where: str) -> tuple[KVCacheTensor, ...]:
        return tuple(
            _build(KVCacheTensor, t, f"{where}[{i}]", {"layers": _tuple})
            for i, t in enumerate(_tuple(value, where))
        )

    def groups(value: object, where: str) -> tuple[KVCacheGroupSpec, ...]:
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


def _role(value: object, path: str) -> KVCacheGroupRole:
    try:
        return KVCacheGroupRole(value)
    except ValueError:
        roles = [r.value for r in KVCacheGroupRole]
        raise ConfigFieldError(path, f"unknown role {show(value)}; use one of {roles}") from None


def engine_config_from_dict(data: object, path: str = "engine") -> EngineConfig:
    sub = {
        "model_config": lambda v, p: _build(ModelConfig, v, p),
        "cache_config": lambda v, p: _build(CacheConfig, v, p),
        "parallel_config": lambda v, p: _build(ParallelConfig, v, p),
        "kv_transfer_config": lambda v, p: None if v is None else _build(KVTransferConfig, v, p),
        "kv_events_config": lambda v, p: None if v is None else _build(KVEventsConfig, v, p),
    }
    return _build(EngineConfig, data, path, sub)


# A description is a few kilobytes; refusing big files keeps a mistyped path (a model
# checkpoint) from being read into memory.
MAX_FILE_BYTES = 1 << 20
# JSON integers longer than this are no size of ours (int64 has 19 digits); Python would
# refuse more than 4,300 digits anyway, with a message naming its own internals.
_MAX_INT_DIGITS = 40
_MAX_NESTING = 32


class _BadNumber(Exception):
    pass


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise _BadNumber(f"an integer of {len(text.lstrip('-'))} digits is too large")
    return int(text)


def _parse_constant(name: str) -> float:
    raise _BadNumber(f"{name} is not a JSON number; use a finite number")


def _depth(value: object) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


def load_description(path: str | Path) -> tuple[EngineConfig, KVCacheConfig]:
    """Reads `{"engine": ..., "kv_cache": ...}` from a JSON file.

    Raises:
      OSError: the file cannot be read (missing, a directory, no permission).
      ConfigFieldError: anything wrong with its content, naming the place: not UTF-8,
        not strict JSON (NaN and Infinity are refused), too large or too deep, or a
        field the config classes refuse.
      ConfigTypeError: a field of the wrong type.
    """
    where = str(path)
    with open(path, "rb") as f:
        raw = f.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigFieldError(
            where, f"is larger than {MAX_FILE_BYTES} bytes; a description is a small JSON file"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigFieldError(
            where,
            f"is not UTF-8 text (byte {raw[exc.start]:#04x} at offset {exc.start}); "
            "save it as UTF-8 JSON",
        ) from None
    try:
        data = json.loads(text, parse_int=_parse_int, parse_constant=_parse_constant)
    except json.JSONDecodeError as exc:
        raise ConfigFieldError(where, f"not valid JSON: {exc}") from None
    except _BadNumber as exc:
        raise ConfigFieldError(where, f"not valid JSON for a config: {exc}") from None
    except RecursionError:
        raise ConfigFieldError(
            where, f"nests deeper than a description can (at most {_MAX_NESTING} levels)"
        ) from None
    if _depth(data) > _MAX_NESTING:
        raise ConfigFieldError(
            where, f"nests deeper than a description can (at most {_MAX_NESTING} levels)"
        )
    if not isinstance(data, Mapping):
        raise ConfigFieldError(where, "expected an object with 'engine' and 'kv_cache'")
    missing = sorted({"engine", "kv_cache"} - set(data))
    if missing:
        raise ConfigFieldError(where, f"missing keys {missing}; add them")
    return engine_config_from_dict(data["engine"]), kv_cache_config_from_dict(data["kv_cache"])
