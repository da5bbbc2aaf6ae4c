"""A read-only, hashable mapping for the loose mappings configs hold (`extra_config`).

Two needs meet here. Our configs are jit statics, so they must be hashable and must not
change after they are built. vLLM's consumers of the same mapping expect the structures
the user wrote: vLLM's tiering spec requires `secondary_tiers` to be a `list` of `dict`s
(`isinstance` checks), so a deep-frozen view (tuples, read-only mappings) breaks them.

So a `FrozenDict` keeps a private deep copy of the caller's containers, with their types
(a list stays a list, a dict a dict, a set a set), hashes and compares a frozen form of
it (lists and tuples as tuples, mappings and sets as frozensets), and hands out a fresh
copy of a container on every read. A consumer may change what it reads; the config
never changes, and its hash stays valid.

Values must be hashable once frozen; anything that is not (a bytearray, a numpy array)
is refused at construction with a `ConfigTypeError` naming the key, instead of the
config failing later inside `jax.jit`. Nesting deeper than `MAX_DEPTH` (or a container
holding itself) is refused as well.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from jax_kvoffload.config._errors import ConfigFieldError, ConfigTypeError

# Values here are `Any`: JSON-like values of any shape that the user wrote, handed to
# consumers (ours, vLLM's) that each read and check their own keys; `object` would make
# every such read cast.
MAX_DEPTH = 64
_FIX = "use JSON-like values: str, int, float, bool, None, and lists and dicts of them"


def _copy(value: Any, where: str, depth: int) -> Any:
    """A private deep copy of the containers in `value`, keeping their types."""
    if isinstance(value, (list, tuple, set, frozenset, Mapping)) and depth >= MAX_DEPTH:
        raise ConfigFieldError(where, f"nests containers deeper than {MAX_DEPTH} levels; {_FIX}")
    if isinstance(value, FrozenDict):
        return value  # immutable already
    if isinstance(value, Mapping):
        return {k: _copy(v, where, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v, where, depth + 1) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy(v, where, depth + 1) for v in value)
    if isinstance(value, set):
        return {_copy(v, where, depth + 1) for v in value}
    return value


def _copy_out(value: Any) -> Any:
    """A fresh copy of the mutable containers in `value` (immutable values are shared)."""
    if isinstance(value, dict):
        return {k: _copy_out(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_out(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy_out(v) for v in value)
    if isinstance(value, set):
        return set(value)
    return value


def freeze(value: Any) -> Any:
    """The hashable form of `value`: sequences as tuples, mappings and sets as frozensets."""
    if isinstance(value, FrozenDict):
        return value._frozen()
    if isinstance(value, Mapping):
        return _FrozenMapping((k, freeze(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(freeze(v) for v in value)
    return value


class _FrozenMapping(frozenset[tuple[object, object]]):
    """A frozen mapping's items; it equals only another frozen mapping, never a set."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return type(other) is _FrozenMapping and frozenset.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = frozenset.__hash__


def thaw(value: Any) -> Any:
    """The JSON-ready form: mappings to dicts, sequences to lists, sets to sorted lists."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((thaw(v) for v in value), key=repr)
    return value


class FrozenDict(Mapping[str, Any]):
    """An immutable mapping that hands out copies of its containers; hashable.

    `FrozenDict(d)["tiers"]` is a new list equal to `d["tiers"]` on every read; two
    FrozenDicts are equal when their frozen forms are (a list equals a tuple of the same
    items), and so are their hashes.
    """

    __slots__ = ("_data", "_hash", "_name")

    def __init__(self, data: Mapping[str, Any] | None = None, *, name: str = "extra_config"):
        if data is not None and not isinstance(data, Mapping):
            raise ConfigTypeError(name, f"must be a mapping (a dict), got {type(data).__name__}")
        self._name = name
        self._data = {k: _copy(v, f"{name}[{k!r}]", 1) for k, v in (data or {}).items()}
        for key, value in self._data.items():
            try:
                hash(freeze(value))
            except TypeError:
                raise ConfigTypeError(
                    f"{name}[{key!r}]",
                    f"holds an unhashable {type(value).__name__} (a config must be hashable "
                    f"to be a jit static); {_FIX}",
                ) from None
        self._hash: int | None = None

    def _frozen(self) -> _FrozenMapping:
        return _FrozenMapping((k, freeze(v)) for k, v in self._data.items())

    def __getitem__(self, key: str) -> Any:
        return _copy_out(self._data[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self._frozen())
        return self._hash

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            try:
                return bool(self._frozen() == freeze(other))
            except TypeError:  # the other holds something unhashable: not equal to us
                return False
        return NotImplemented

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"
