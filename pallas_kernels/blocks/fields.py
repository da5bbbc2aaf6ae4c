"""Field checks shared by the backend configs: each failure names the config, the field,
the value and the fix (the field's default), so ``TpuConfig(lanes=0)`` fails where it is
written instead of as a ``ZeroDivisionError`` inside a kernel."""

from __future__ import annotations

import dataclasses
import numbers
from typing import TYPE_CHECKING, Protocol

from .errors import BackendConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    class WordConfig(DataclassInstance, Protocol):
        """A backend config (a frozen dataclass) with a ``word_bytes`` field."""

        @property
        def word_bytes(self) -> int | None: ...


WORD_BYTES = (1, 2, 4)


def _default(config: DataclassInstance, name: str) -> object:
    return {f.name: f.default for f in dataclasses.fields(config)}[name]


def check_int(
    config: DataclassInstance, name: str, *, minimum: int = 1, none_ok: bool = False
) -> None:
    """``config.<name>`` is an int >= ``minimum`` (or None when ``none_ok``); numpy
    integers are stored as ``int`` so configs stay equal and hash alike as jit statics."""
    value = getattr(config, name)
    if value is None and none_ok:
        return
    owner, default = type(config).__name__, _default(config, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{owner}.{name} must be an int{' or None' if none_ok else ''}, got "
            f"{type(value).__name__} {value!r}; use e.g. {name}={default!r}"
        )
    if value < minimum:
        raise BackendConfigError(
            f"{owner}.{name}={value} must be >= {minimum}; use e.g. {name}={default!r} "
            "(the default)"
        )
    object.__setattr__(config, name, int(value))


def check_power_of_two(config: DataclassInstance, name: str, *, maximum: int) -> None:
    check_int(config, name)
    value = getattr(config, name)
    if value & (value - 1) or value > maximum:
        raise BackendConfigError(
            f"{type(config).__name__}.{name}={value} must be a power of two <= {maximum}; "
            f"use e.g. {name}={_default(config, name)!r} (the default)"
        )


def check_word_bytes(config: WordConfig) -> None:
    value = config.word_bytes
    if value is None:
        return
    check_int(config, "word_bytes", none_ok=True)
    if config.word_bytes not in WORD_BYTES:
        raise BackendConfigError(
            f"{type(config).__name__}.word_bytes={value} must be 1, 2 or 4 (bytes per word "
            "moved), or None to pick the widest that divides a page"
        )
