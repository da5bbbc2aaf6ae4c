"""A read-only, hashable mapping, so configs holding loose mappings stay frozen."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


def freeze(value: Any) -> Any:
    """Deeply converts dicts to `FrozenDict` and lists to tuples; leaves scalars as they are."""
    if isinstance(value, Mapping):
        return FrozenDict(value)
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """The JSON-ready inverse of `freeze`: mappings to dicts, tuples to lists."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


class FrozenDict(Mapping[str, Any]):
    """An immutable mapping whose values are frozen recursively; hashable when they are."""

    __slots__ = ("_data", "_hash")

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        self._data = {k: freeze(v) for k, v in (data or {}).items()}
        self._hash: int | None = None

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(frozenset(self._data.items()))
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._data == {k: freeze(v) for k, v in other.items()}
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"
