"""Field checks shared by the config dataclasses; each error names the field, shows the
value and says what to pass instead.

The `*_field` helpers validate `obj.<name>` and store the normalised value back (a frozen
dataclass, so through `object.__setattr__`): `np.int64(16)` becomes `16`, so configs stay
hashable and JSON-ready whatever integer type the caller had.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import TYPE_CHECKING, TypeGuard, TypeVar

import numpy as np

from jax_kvoffload.config._errors import ConfigFieldError, ConfigTypeError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_T = TypeVar("_T", bound="DataclassInstance")

_SHOW_LIMIT = 80
# Sizes, counts and ids travel as int64 (numpy, XLA, the OS): larger ones overflow there.
MAX_INT = 2**63 - 1


def show(value: object) -> str:
    """`repr(value)` cut to a readable length (a 5,000-digit int has no repr in 3.11+)."""
    try:
        text = repr(value)
    except ValueError:  # int too large to print (sys.get_int_max_str_digits)
        return f"<int of {int(value).bit_length()} bits>"  # type: ignore[call-overload]
    if len(text) > _SHOW_LIMIT:
        text = text[: _SHOW_LIMIT - 3] + "..."
    return text


def _typed(value: object) -> str:
    return f"{type(value).__name__} {show(value)}"


def is_int(value: object) -> TypeGuard[numbers.Integral]:
    """Python and numpy integers; never bools (True is not a size)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_int(
    field: str, value: object, *, minimum: int | None = None, bounded: bool = True
) -> int:
    """An integer (numpy's too, not a bool) at least `minimum`, returned as a Python int;
    `bounded`: within int64 (the boundary's fields, vLLM's results, are not bounded)."""
    if not is_int(value):
        raise ConfigTypeError(field, f"must be an int, got {_typed(value)}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ConfigFieldError(
            field, f"must be >= {minimum}, got {show(value)}; use {minimum} or more"
        )
    if bounded and abs(value) > MAX_INT:
        raise ConfigFieldError(
            field,
            f"{show(value)} is past int64 ({MAX_INT}), where sizes and counts overflow; "
            "use the engine's real value",
        )
    return value


def check_optional_int(
    field: str, value: object, *, minimum: int | None = None, bounded: bool = True
) -> int | None:
    return None if value is None else check_int(field, value, minimum=minimum, bounded=bounded)


def check_bool(field: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigTypeError(field, f"must be True or False, got {_typed(value)}")
    return bool(value)


def check_str(field: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigTypeError(field, f"must be a str, got {_typed(value)}")
    return value


def check_optional_str(field: str, value: object) -> str | None:
    return None if value is None else check_str(field, value)


def check_ratio(field: str, value: object) -> int | Fraction:
    """An int or a Fraction (vLLM's `tokens_per_state` may be 1/2)."""
    if isinstance(value, Fraction):
        return value
    if not is_int(value):
        raise ConfigTypeError(field, f"must be an int or a fractions.Fraction, got {_typed(value)}")
    return int(value)


def check_names(field: str, value: object) -> tuple[str, ...]:
    """An ordered sequence of strings, returned as a tuple.

    A lone str is refused (it would be split into letters), and so are sets: layer order
    is meaningful and a set has none.
    """
    if isinstance(value, (str, bytes, set, frozenset)) or not isinstance(value, Iterable):
        raise ConfigTypeError(
            field, f"must be a list or tuple of str, got {_typed(value)}; pass e.g. ('layer.0',)"
        )
    names = tuple(value)
    for i, name in enumerate(names):
        check_str(f"{field}[{i}]", name)
    return names


def set_fields(
    obj: object, check: Callable[..., object], names: Iterable[str], **kw: object
) -> None:
    """Applies `check(name, value, **kw)` to each named field of `obj` and stores the result."""
    for name in names:
        object.__setattr__(obj, name, check(name, getattr(obj, name), **kw))


def int_fields(obj: object, *names: str, minimum: int | None = None, bounded: bool = True) -> None:
    set_fields(obj, check_int, names, minimum=minimum, bounded=bounded)


def optional_int_fields(
    obj: object, *names: str, minimum: int | None = None, bounded: bool = True
) -> None:
    set_fields(obj, check_optional_int, names, minimum=minimum, bounded=bounded)


def bool_fields(obj: object, *names: str) -> None:
    set_fields(obj, check_bool, names)


def str_fields(obj: object, *names: str) -> None:
    set_fields(obj, check_str, names)


def optional_str_fields(obj: object, *names: str) -> None:
    set_fields(obj, check_optional_str, names)


def from_trusted_fields(cls: type[_T], /, **values: object) -> _T:
    """An instance of the config dataclass `cls` holding `values` as they are, without
    the constructor's checks.

    For adapters whose input was built and validated by vLLM's own classes
    (`jax_kvoffload.bridge.vllm`): vLLM checks few of these fields and asserts some only
    where they are used (a sliding window when the window is computed, the padding when
    the page size is read); the translation repeats those checks at the same points, so
    the answer and the error are vLLM's. Values must already be in this library's types
    (numpy dtypes, `KVQuantMode`, tuples). Fields not given take their defaults; fields a
    post-init would derive (`head_size_v`, an MLA `page_size_padded`, a wrapper's
    `dcp_sharded`) must be given as vLLM derived them.
    """
    obj: _T = object.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.name in values:
            value = values.pop(f.name)
        elif f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            raise ConfigTypeError(f.name, f"is required by {cls.__name__}; pass it")
        object.__setattr__(obj, f.name, value)
    if values:
        raise ConfigTypeError(sorted(values)[0], f"is not a field of {cls.__name__}; drop it")
    return obj
