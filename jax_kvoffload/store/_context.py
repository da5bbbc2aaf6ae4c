"""Lookup results and the per-request context the manager and policies share."""

from __future__ import annotations

import abc
import enum
import operator
from collections.abc import Callable
from typing import TypeVar

from ._errors import StoreError, StoreTypeError

__all__ = [
    "AbstractRequestContext",
    "LookupResult",
    "RequestContext",
    "check_context",
    "position_reader",
    "register_plain_context",
]

_T = TypeVar("_T")


class LookupResult(enum.Enum):
    """Answer of ``HostStore.lookup`` (vLLM 0.33.0 ``LookupResult``,
    ``vllm/v1/kv_offload/base.py``).

    Attributes:
      MISS: The key is not stored (never stored, evicted, failed, or reset).
      HIT: The key is stored and readable; ``prepare_load`` may pin it now.
      HIT_PENDING: The key is allocated but its store has not completed; it is not
        readable yet. vLLM's scheduler counts it as a hit and asks again later.
      RETRY: Ask again later. The host store never returns it; tiered managers do.
    """

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"
    RETRY = "retry"


class AbstractRequestContext(abc.ABC):
    """What the store and its policies read from a per-request context.

    The method names are vLLM 0.33.0's ``ReqContext`` names, so that vLLM's own
    context passes straight through the bridge (which registers it as a virtual
    subclass) and policies written for vLLM read positions the way they do there.

    Contract: ``get_offload_key_position`` is a pure lookup; ``get_state`` /
    ``set_state`` keep one scratch object per class (components tag their state with
    an owner and a cache generation, so a foreign or stale object is ignored).

    Attributes:
      req_id: The engine's request id (messages and logs only).
    """

    req_id: str

    @abc.abstractmethod
    def get_offload_key_position(self, key: bytes) -> int | None:
        """Returns the recorded end token position of ``key``, or None."""

    @abc.abstractmethod
    def get_state(self, cls: type[_T]) -> _T | None:
        """Returns the scratch state of class ``cls``, or None."""

    @abc.abstractmethod
    def set_state(self, state: object) -> None:
        """Stores ``state`` as the scratch state of its class."""


class RequestContext(AbstractRequestContext):
    """Per-request state shared by the manager and the eviction policy.

    One context lives as long as one engine request (vLLM's ``ReqContext``). The
    scheduler records the end token position of each key it offers or loads
    (``set_key_position``); policies use the positions to rank a request's chunks so
    that its tail is evicted before its head. Components keep private scratch state in
    the context, one object per state class, tagged with the owner and the cache
    generation so that a ``reset_cache()`` invalidates it.

    ``get_offload_key_position`` / ``set_offload_key_position`` are vLLM's names for
    ``get_key_position`` / ``set_key_position`` (policies written for vLLM call them).

    Attributes:
      req_id: The engine's request id, used only in messages and logs.
    """

    __slots__ = ("_positions", "_state", "req_id")

    def __init__(self, req_id: str = "") -> None:
        if not isinstance(req_id, str):
            raise StoreTypeError(
                f"req_id must be a str, got {type(req_id).__name__}: {req_id!r}; "
                "pass the engine's request id as text."
            )
        self.req_id = req_id
        self._positions: dict[bytes, int] = {}
        self._state: dict[type, object] = {}

    def __repr__(self) -> str:
        return f"RequestContext(req_id={self.req_id!r}, positions={len(self._positions)})"

    def set_key_position(self, key: bytes, end_position: int) -> None:
        """Records the end token position of the chunk keyed by ``key``.

        Args:
          key: An offload key of this request.
          end_position: Tokens up to the end of the chunk, ``(k + 1) * tokens_per_chunk``
            for the k-th chunk; must be >= 0.

        Raises:
          StoreTypeError: if ``key`` is not bytes or ``end_position`` not an int.
          StoreError: if ``end_position`` is negative.
        """
        if not isinstance(key, bytes):
            raise StoreTypeError(
                f"key must be bytes (an offload key), got {type(key).__name__}: {key!r}."
            )
        if isinstance(end_position, bool) or not isinstance(end_position, int):
            raise StoreTypeError(
                f"end_position must be an int, got {type(end_position).__name__}: {end_position!r}."
            )
        if end_position < 0:
            raise StoreError(
                f"end_position={end_position} must be >= 0: it counts the tokens up to "
                "the end of the chunk, (k + 1) * tokens_per_chunk for chunk k."
            )
        self._positions[key] = end_position

    set_offload_key_position = set_key_position

    def get_key_position(self, key: bytes) -> int | None:
        """Returns the recorded end position of ``key``, or None if none was recorded."""
        return self._positions.get(key)

    def get_offload_key_position(self, key: bytes) -> int | None:
        """Returns the recorded end position of ``key`` (vLLM's name)."""
        return self._positions.get(key)

    def get_state(self, cls: type[_T]) -> _T | None:
        """Returns the scratch state of class ``cls``, or None (for store components)."""
        return self._state.get(cls)  # type: ignore[return-value]

    def set_state(self, state: object) -> None:
        """Stores ``state`` as the scratch state of its class (for store components)."""
        self._state[type(state)] = state


# Context types already checked; `type(ctx) in` is the per-call fast path.
_CONTEXT_TYPES: set[type] = {RequestContext}


def check_context(ctx: object) -> None:
    """Raises unless ``ctx`` is None or an ``AbstractRequestContext``."""
    if ctx is None or type(ctx) in _CONTEXT_TYPES:
        return
    if isinstance(ctx, AbstractRequestContext):
        _CONTEXT_TYPES.add(type(ctx))
        return
    raise StoreTypeError(
        f"ctx must be a RequestContext (or vLLM's ReqContext through "
        f"jax_kvoffload.bridge.vllm), or None; got {type(ctx).__name__}: {ctx!r}."
    )


# Exact context types whose `get_offload_key_position` is a plain `.get` of an instance
# dict, with that dict's attribute getter. The store and the built-in policies read a
# position for nearly every key a request stores, loads or finishes with; the dict's
# C-level `get` saves one Python frame per key. Subclasses are not listed: they may
# override the method.
_POSITION_DICTS: dict[type, Callable[[object], Callable[[bytes], int | None]]] = {
    RequestContext: operator.attrgetter("_positions.get")
}


def register_plain_context(cls: type, positions_attr: str) -> None:
    """Declares that ``cls(...).get_offload_key_position(key)`` is
    ``getattr(ctx, positions_attr).get(key)`` (vLLM's ``ReqContext``: the bridge
    checks that on a probe before it registers it)."""
    _POSITION_DICTS[cls] = operator.attrgetter(f"{positions_attr}.get")


def position_reader(ctx: AbstractRequestContext) -> Callable[[bytes], int | None]:
    """Returns ``ctx.get_offload_key_position``, or the same read without its frame."""
    getter = _POSITION_DICTS.get(type(ctx))
    if getter is None:
        return ctx.get_offload_key_position
    return getter(ctx)
