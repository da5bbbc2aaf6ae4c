"""Argument checks and error texts shared by the host store's entry points."""

from __future__ import annotations

from ._context import check_context
from ._errors import KeyNotPinnedError, StoreError, StoreTypeError
from ._keys import OffloadKey

__all__ = ["check_int", "need_context", "not_bytes", "not_pinned"]


def check_int(name: str, value: object, minimum: int) -> int:
    """Returns ``value`` if it is an int (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise StoreTypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}.")
    if value < minimum:
        raise StoreError(f"{name}={value} must be >= {minimum}.")
    if value > 2**63 - 1:  # counts travel as int64 (numpy, the policies' arrays)
        raise StoreError(
            f"{name}={value} is past int64 ({2**63 - 1}); use the number the host can hold."
        )
    return value


def not_bytes(key: object) -> StoreTypeError:
    return StoreTypeError(
        f"key must be bytes (an offload key), got {type(key).__name__}: {key!r}; "
        "build keys with make_offload_key()."
    )


def need_context(method: str, ctx: object) -> None:
    """Raises unless ``ctx`` is a request context (None is not one here)."""
    check_context(ctx)
    if ctx is None:
        raise StoreTypeError(
            f"{method}(ctx) needs the request's context, got None; pass the "
            "RequestContext the request's other calls use."
        )


def not_pinned(key: OffloadKey, count: int, ref_cnt: int) -> KeyNotPinnedError:
    loads = max(ref_cnt, 0)
    return KeyNotPinnedError(
        f"Chunk {key!r} ref_cnt is already {loads}: {count} complete_load(s) for "
        f"{loads} load(s) in flight; call complete_load once per prepare_load."
    )
