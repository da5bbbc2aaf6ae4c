"""Lookup results and the per-request context the manager and policies share."""

from __future__ import annotations

import enum
from typing import TypeVar

__all__ = ["LookupResult", "RequestContext"]

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


class RequestContext:
    """Per-request state shared by the manager and the eviction policy.

    One context lives as long as one engine request (vLLM's ``ReqContext``). The
    scheduler records the end token position of each key it offers or loads
    (``set_key_position``); policies use the positions to rank a request's chunks so
    that its tail is evicted before its head. Components keep private scratch state in
    the context, one object per state class, tagged with the owner and the cache
    generation so that a ``reset_cache()`` invalidates it.

    Attributes:
      req_id: The engine's request id, used only in messages and logs.
    """

    __slots__ = ("_positions", "_state", "req_id")

    def __init__(self, req_id: str = "") -> None:
        if not isinstance(req_id, str):
            raise TypeError(f"req_id must be a str, got {type(req_id).__name__}.")
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
        """
        if not isinstance(key, bytes):
            raise TypeError(f"key must be bytes, got {type(key).__name__}.")
        if isinstance(end_position, bool) or not isinstance(end_position, int):
            raise TypeError(f"end_position must be an int, got {type(end_position).__name__}.")
        if end_position < 0:
            raise ValueError(f"end_position={end_position} must be >= 0.")
        self._positions[key] = end_position

    def get_key_position(self, key: bytes) -> int | None:
        """Returns the recorded end position of ``key``, or None if none was recorded."""
        return self._positions.get(key)

    def get_state(self, cls: type[_T]) -> _T | None:
        """Returns the scratch state of class ``cls``, or None (for store components)."""
        return self._state.get(cls)  # type: ignore[return-value]

    def set_state(self, state: object) -> None:
        """Stores ``state`` as the scratch state of its class (for store components)."""
        self._state[type(state)] = state
