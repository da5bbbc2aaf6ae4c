"""Cache events: which keys became readable in, or left, the host tier."""

from __future__ import annotations

import enum
from typing import NamedTuple

from ._keys import OffloadKey

__all__ = ["Medium", "OffloadingEvent"]


class Medium(enum.Enum):
    """Where the chunks of an event live (vLLM ``Medium``; ``CPU`` is host memory)."""

    CPU = "CPU"
    STORAGE = "STORAGE"


class OffloadingEvent(NamedTuple):
    """One batch of keys stored into or removed from a tier (vLLM's ``OffloadingEvent``,
    ``vllm/v1/kv_offload/base.py``).

    An immutable named tuple (cheap to build: the scheduler drains events every step).

    Attributes:
      keys: The keys, in the order the manager processed them.
      medium: The tier's medium; the host store always reports ``Medium.CPU``.
      removed: False for "these keys became readable" (a completed store), True for
        "these keys left the tier" (an eviction or a failed store).
      metadata_only: True only for removals after a failed store: the keys were
        announced to nobody (no store event was emitted for them), so consumers that
        mirror the cache only need to drop their bookkeeping. Such a removal is dropped
        by ``take_events`` for keys that were allocated again before the drain.
    """

    keys: tuple[OffloadKey, ...]
    medium: Medium = Medium.CPU
    removed: bool = False
    metadata_only: bool = False
