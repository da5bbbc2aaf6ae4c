"""Offload keys: an engine block hash plus the KV-cache group index, as bytes.

The byte layout is vLLM 0.33.0's ``OffloadKey`` (``vllm/v1/kv_offload/base.py``): ``block_hash +
group_idx.to_bytes(4, "big")``. Keys are content-derived and stable across processes;
nothing here uses Python's ``hash()``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NewType

from ._errors import StoreError, StoreTypeError

__all__ = [
    "GROUP_IDX_BYTES",
    "OffloadKey",
    "check_keys",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
]

OffloadKey = NewType("OffloadKey", bytes)

# vLLM packs the group index into the last 4 bytes, big-endian (vllm/v1/kv_offload/base.py).
GROUP_IDX_BYTES = 4
_MAX_GROUP_IDX = (1 << (8 * GROUP_IDX_BYTES)) - 1


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Builds the key of one chunk: the hash ending the chunk plus its group index.

    Args:
      block_hash: The engine's content hash of the block that ends the chunk, as bytes.
      group_idx: Index of the KV-cache group, in [0, 2**32).

    Returns:
      ``block_hash + group_idx.to_bytes(4, "big")``, vLLM 0.33.0's layout.

    Raises:
      StoreTypeError: if ``block_hash`` is not bytes or ``group_idx`` is not an int.
      StoreError: if ``group_idx`` is out of range.
    """
    if not isinstance(block_hash, bytes):
        raise StoreTypeError(
            f"block_hash must be bytes, got {type(block_hash).__name__}: {block_hash!r}; "
            "convert the engine's hash with bytes(...) first."
        )
    if isinstance(group_idx, bool) or not isinstance(group_idx, int):
        raise StoreTypeError(
            f"group_idx must be an int, got {type(group_idx).__name__}: {group_idx!r}."
        )
    if not 0 <= group_idx <= _MAX_GROUP_IDX:
        raise StoreError(
            f"group_idx={group_idx} must be in [0, 2**32): it is the KV-cache group's "
            "index, packed into 4 bytes."
        )
    return OffloadKey(block_hash + group_idx.to_bytes(GROUP_IDX_BYTES, "big"))


def _check_key_length(key: bytes) -> None:
    if not isinstance(key, bytes):
        raise StoreTypeError(
            f"key must be bytes (an offload key), got {type(key).__name__}: {key!r}; "
            "build keys with make_offload_key()."
        )
    if len(key) < GROUP_IDX_BYTES:
        raise StoreError(
            f"offload key {key!r} has {len(key)} bytes; a key ends with a "
            f"{GROUP_IDX_BYTES}-byte group index, build it with make_offload_key()."
        )


def get_offload_block_hash(key: bytes) -> bytes:
    """Returns the block-hash part of ``key`` (all but the last 4 bytes)."""
    _check_key_length(key)
    return key[:-GROUP_IDX_BYTES]


def get_offload_group_idx(key: bytes) -> int:
    """Returns the KV-cache group index packed into the last 4 bytes of ``key``."""
    _check_key_length(key)
    return int.from_bytes(key[-GROUP_IDX_BYTES:], "big")


def check_keys(keys: Iterable[object], name: str = "keys") -> list[OffloadKey]:
    """Returns ``keys`` as a list after checking that each one is bytes.

    Raises:
      StoreTypeError: if ``keys`` is not iterable, is a bytes object itself (a single
        key passed where a sequence is expected), or an element is not bytes.
      StoreError: if a key is shorter than the 4-byte group index.
    """
    if type(keys) is list:
        out = keys  # not copied: the store keeps no reference to the caller's list
    elif isinstance(keys, (bytes, bytearray, str)):
        raise StoreTypeError(
            f"{name} must be a sequence of bytes keys, got a single "
            f"{type(keys).__name__} {keys!r}; wrap it in a list."
        )
    else:
        try:
            out = list(keys)
        except TypeError:
            raise StoreTypeError(
                f"{name} must be a sequence of bytes keys, got {type(keys).__name__}: {keys!r}."
            ) from None
    for key in out:
        # One pass tests both rules (the exact-type test is the fast path; subclasses
        # of bytes are accepted too); the errors come from the passes below, which
        # report a wrong type before a short key, as the rules are listed.
        if (type(key) is not bytes and not isinstance(key, bytes)) or len(key) < GROUP_IDX_BYTES:
            break
    else:
        return out
    for key in out:
        if not isinstance(key, bytes):
            raise StoreTypeError(
                f"every element of {name} must be bytes (an offload key), "
                f"got {type(key).__name__}: {key!r}; build keys with make_offload_key()."
            )
    for key in out:
        _check_key_length(key)
    raise AssertionError("unreachable: a key failed the test above")  # pragma: no cover
