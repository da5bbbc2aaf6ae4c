"""Checks on ids and counts (chunk ids, block ids, groups): ints only, never truncated.

Every pool checks its arguments with these; the transfer engine and the offloader check
job arguments with the same ones (through `hostmem.internals`), so an id refused in one
place is refused everywhere with the same message.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import SupportsIndex, cast

import numpy as np

from jax_kvoffload.errors import KVOffloadTypeError, KVOffloadValueError

__all__ = ["check_index", "check_indices"]


def check_index(name: str, value: object) -> int:
    """`value` as an int; refuses bools, floats (never truncated) and other types."""
    if isinstance(value, (bool, np.bool_)):
        raise KVOffloadTypeError(f"{name}={value!r} must be an int, not a bool")
    try:
        # ints and numpy integers only: 2.0 is refused
        return operator.index(cast(SupportsIndex, value))
    except TypeError:
        raise KVOffloadTypeError(
            f"{name} must be an int, got {type(value).__name__} {_short(value)}"
        ) from None


def check_indices(name: str, values: object) -> np.ndarray:
    """A sequence (or 1-D array) of ints as int64; floats and bools are refused."""
    if isinstance(values, np.ndarray):
        array = values
    elif isinstance(values, Sequence) and not isinstance(values, (str, bytes, bytearray)):
        # numpy would turn True into 1 silently (and a mix of types into strings).
        if any(type(v) is bool or type(v) is np.bool_ for v in values):
            array = np.asarray(values, dtype=object)
        else:
            try:
                array = np.asarray(values)
            except (TypeError, ValueError, OverflowError):
                array = np.asarray(values, dtype=object)
    else:
        raise KVOffloadTypeError(
            f"{name} must be a sequence of ints, got {type(values).__name__} {_short(values)}"
        )
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1:
        raise KVOffloadValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.dtype.kind == "O":  # huge Python ints, or mixed types: check one by one
        items = [check_index(f"{name}[{i}]", v) for i, v in enumerate(array.tolist())]
        bad = [v for v in items if not -(2**62) <= v < 2**62]
        if bad:
            raise KVOffloadValueError(f"{name} holds {bad[0]}, far outside any cache")
        return np.asarray(items, dtype=np.int64)
    if array.dtype.kind not in "iu":
        first = next(i for i, v in enumerate(array.tolist()) if not _is_int(v))
        raise KVOffloadTypeError(
            f"{name}[{first}]={array.tolist()[first]!r} must be an int "
            f"({name} has dtype {array.dtype}; ids are never truncated)"
        )
    if array.dtype.kind == "u" and array.dtype.itemsize == 8 and int(array.max()) >= 2**63:
        raise KVOffloadValueError(f"{name} holds {int(array.max())}, far outside any cache")
    return array.astype(np.int64, copy=False)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
