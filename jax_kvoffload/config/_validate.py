"""Field checks shared by the config dataclasses; each error names the field."""

from __future__ import annotations

from fractions import Fraction

from jax_kvoffload.config._errors import ConfigFieldError


def check_int(field: str, value: object, *, minimum: int | None = None) -> int:
    """An int (not a bool) at least `minimum`; returns it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{field} must be an int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigFieldError(field, f"must be >= {minimum}, got {value}")
    return value


def check_optional_int(field: str, value: object, *, minimum: int | None = None) -> int | None:
    return None if value is None else check_int(field, value, minimum=minimum)


def check_bool(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{field} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_str(field: str, value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a str, got {type(value).__name__} {value!r}")
    return value


def check_ratio(field: str, value: object) -> int | Fraction:
    """An int or a Fraction (vLLM's `tokens_per_state` may be 1/2)."""
    if isinstance(value, bool) or not isinstance(value, (int, Fraction)):
        raise TypeError(f"{field} must be an int or Fraction, got {value!r}")
    return value


def check_names(field: str, value: object) -> tuple[str, ...]:
    """A sequence of strings, returned as a tuple (a lone str is refused, not split)."""
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise TypeError(f"{field} must be a sequence of str, got {value!r}")
    names = tuple(value)
    for name in names:
        check_str(f"{field}[]", name)
    return names
