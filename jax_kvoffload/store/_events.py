"""Cache events: which keys became readable in, or left, the host tier."""

from __future__ import annotations

from typing import NamedTuple

from jax_kvoffload.config.internals import Medium

from ._keys import OffloadKey

__all__ = ["OffloadingEvent"]


class OffloadingEvent(NamedTuple):
    """One batch of keys stored into or removed from a tier (vLLM's ``OffloadingEvent``,
    ``vllm/v1/kv_offload/base.py``).

    An immutable named tuple (cheap to build: the scheduler drains events every step).

    Attributes:
      keys: The keys, in the order the manager processed them.
      medium: The tier's medium (``jax_kvoffload.config.internals.Medium``, re-exported
        as ``store.Medium``); the host store always reports ``Medium.CPU`` (vLLM's name
        for ``Medium.HOST``).
      removed: False for "these keys became readable" (a completed store), True for
        "these keys left the tier" (an eviction or a failed store).
      metadata_only: True only for removals after a failed store: the keys were
        announced to nobody (no store event was emitted for them), so consumers that
        mirror the cache only need to drop their bookkeeping. Such a removal is dropped
        by ``take_events`` for keys that were allocated again before the drain.
    """

    keys: tuple[OffloadKey, ...]
    medium: Medium = Medium.HOST
    removed: bool = False
    metadata_only: bool = False
