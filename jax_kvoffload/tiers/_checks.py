"""Argument checks shared by the tiers: keys, buffers, (key, buffer) items."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from jax_kvoffload.tiers._entry import MAX_KEY_BYTES
from jax_kvoffload.tiers._errors import TierKeyError

if TYPE_CHECKING:
    from jax_kvoffload.tiers._base import Buffer

__all__ = ["byte_view", "check_items", "check_keys"]


def check_keys(keys: Sequence[bytes], name: str = "keys", *, min_bytes: int = 1) -> list[bytes]:
    """`keys` as a list, after checking each (bytes of `min_bytes`..MAX_KEY_BYTES)."""
    if isinstance(keys, (bytes, bytearray, str)):
        raise TierKeyError(
            f"{name} must be a sequence of bytes keys, got one {type(keys).__name__}; "
            "wrap it in a list"
        )
    try:
        keys = list(keys)
    except TypeError:
        raise TierKeyError(
            f"{name} must be a sequence of bytes keys, got {type(keys).__name__}"
        ) from None
    for key in keys:
        if not isinstance(key, bytes):
            raise TierKeyError(
                f"every key in {name} must be bytes (an offload key), got {type(key).__name__}"
            )
        if not min_bytes <= len(key) <= MAX_KEY_BYTES:
            raise TierKeyError(
                f"a key in {name} has {len(key)} bytes; keys are {min_bytes}..{MAX_KEY_BYTES} "
                "bytes (an offload key: a block hash and a 4-byte group index)"
            )
    return keys


def byte_view(buf: Buffer, name: str, *, writable: bool = False) -> memoryview:
    """`buf` as a flat, contiguous byte view (no copy)."""
    try:
        view = memoryview(buf)  # type: ignore[arg-type]
    except TypeError:
        raise TierKeyError(
            f"{name} must support the buffer protocol (bytes, memoryview, numpy array), "
            f"got {type(buf).__name__}"
        ) from None
    if not view.c_contiguous:
        raise TierKeyError(f"{name} must be C-contiguous; copy it first (numpy.ascontiguousarray)")
    if writable and view.readonly:
        raise TierKeyError(f"{name} must be writable: a load writes the payload into it")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def check_items(
    items: Sequence[tuple[bytes, Buffer]], name: str, *, writable: bool = False, min_bytes: int = 1
) -> list[tuple[bytes, memoryview]]:
    """`[(key, byte view)]` after checking every key and buffer; duplicate keys refused."""
    if isinstance(items, (bytes, bytearray, str)):
        raise TierKeyError(f"{name} must be a sequence of (key, buffer) pairs")
    try:
        items = list(items)
    except TypeError:
        raise TierKeyError(
            f"{name} must be a sequence of (key, buffer) pairs, got {type(items).__name__}"
        ) from None
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, tuple) or len(item) != 2:
            raise TierKeyError(
                f"{name}[{i}] must be a (key, buffer) pair, got {type(item).__name__}"
            )
        key, buf = item
        check_keys([key], f"{name}[{i}]", min_bytes=min_bytes)
        out.append((key, byte_view(buf, f"{name}[{i}] buffer", writable=writable)))
    if len({k for k, _ in out}) != len(out):
        raise TierKeyError(f"{name} holds a key twice; each key at most once per job")
    return out
