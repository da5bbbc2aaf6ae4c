"""The load path of the host store: pinning chunks for reads and releasing them.

`HostStore` owns one `LoadPath` and delegates ``prepare_load`` / ``complete_load`` to
it; the path is given the store's policy and its shared `StoreState` when built.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._access import RequestFinishedError, access_state
from ._checks import not_pinned
from ._context import AbstractRequestContext, check_context
from ._errors import KeyNotReadyError, KeyNotStoredError, StoreError
from ._keys import OffloadKey, check_keys
from ._policy_base import AbstractEvictionPolicy, ChunkStatus
from ._state import StoreState

__all__ = ["LoadPath"]


def _not_loadable(key: OffloadKey, chunk: ChunkStatus | None) -> StoreError:
    # `.key`: the callers above the store (KVOffloader.load) say which of their inputs.
    if chunk is None:
        missing = KeyNotStoredError(
            f"Chunk {key!r} not found in cache: prepare_load takes keys that lookup() "
            "reported as HIT."
        )
        missing.key = key
        return missing
    pending = KeyNotReadyError(
        f"Chunk {key!r} is not ready for reading: its store is in flight; load it "
        "after complete_store(..., success=True)."
    )
    pending.key = key
    return pending


def _not_unpinnable(key: OffloadKey, chunk: ChunkStatus | None, keys: list) -> StoreError:
    if chunk is None:
        return KeyNotStoredError(
            f"Chunk {key!r} not found in cache: complete_load takes the keys of an "
            "earlier prepare_load."
        )
    return not_pinned(key, keys.count(key), chunk.ref_cnt)


class LoadPath:
    """``prepare_load`` / ``complete_load`` of ``HostStore`` (vLLM's ``cpu/manager.py``).

    Args:
      policy: The store's eviction policy (told which chunks stop and start being
        evictable).
      batched: Whether ``policy`` takes batches (``BatchHooks``); otherwise it gets
        vLLM's per-key hook calls, in vLLM's order.
      state: The store's chunk accounting (``num_evictable``, ``generation``).
    """

    def __init__(self, policy: AbstractEvictionPolicy, batched: bool, state: StoreState) -> None:
        self._policy = policy
        self._get = policy.get
        self._batched = batched
        self._state = state

    def prepare_load(
        self, keys: Sequence[OffloadKey], ctx: AbstractRequestContext | None = None
    ) -> tuple[int, ...]:
        """Pins ``keys`` for reading and returns their chunk ids, in key order.

        All or nothing: if a key is absent or not ready, nothing is pinned.

        Raises:
          StoreTypeError: if a key is not bytes or ``ctx`` is not a context.
          KeyNotStoredError: if a key is not in the store.
          KeyNotReadyError: if a key's store has not completed (HIT_PENDING).
          RequestFinishedError: if ``ctx`` finished and a key is new to it.
        """
        keys = check_keys(keys)
        check_context(ctx)
        get = self._get
        chunks: list[ChunkStatus] = []
        if self._batched:
            # One pass: pin as we check, and undo the pins if a key is refused.
            pinned = []
            for key in keys:
                chunk = get(key)
                if chunk is None or chunk.ref_cnt < 0:
                    for done in chunks:
                        done.ref_cnt -= 1
                    raise _not_loadable(key, chunk)
                if chunk.ref_cnt == 0:
                    pinned.append(key)
                chunk.ref_cnt += 1
                chunks.append(chunk)
            state = None
            if ctx is not None:
                state = access_state(ctx, self._state, self._state.generation)
                try:
                    state.check_open(keys, ctx)
                except RequestFinishedError:
                    for done in chunks:
                        done.ref_cnt -= 1
                    raise
            if pinned:
                self._state.num_evictable -= len(pinned)
                self._policy.mark_non_evictable_many(pinned)  # type: ignore[attr-defined]
        else:
            for key in keys:
                chunk = get(key)
                if chunk is None or chunk.ref_cnt < 0:
                    raise _not_loadable(key, chunk)
                chunks.append(chunk)
            state = None
            if ctx is not None:
                state = access_state(ctx, self._state, self._state.generation)
                state.check_open(keys, ctx)
            # vLLM's order: each key's hook right before its ref count changes.
            mark_non_evictable = self._policy.mark_non_evictable
            for key, chunk in zip(keys, chunks, strict=True):
                if chunk.ref_cnt == 0:
                    mark_non_evictable(key)
                    self._state.num_evictable -= 1
                chunk.ref_cnt += 1
        if state is not None:
            state.record(keys, self._policy, ctx)
            state.record_reused(keys)
        return tuple([chunk.chunk_id for chunk in chunks])

    def complete_load(
        self, keys: Sequence[OffloadKey], ctx: AbstractRequestContext | None = None
    ) -> None:
        """Unpins ``keys`` after their load finished; all or nothing.

        Raises:
          KeyNotStoredError: if a key is not in the store.
          KeyNotPinnedError: if a key has fewer loads in flight than it appears here.
        """
        keys = check_keys(keys)
        check_context(ctx)
        get = self._get
        chunks: list[ChunkStatus] = []
        if self._batched:
            # One pass: unpin as we check (a key listed more often than it is pinned
            # meets ref count 0 on the way), and undo the unpins if a key is refused.
            released = []
            for key in keys:
                chunk = get(key)
                if chunk is None or chunk.ref_cnt <= 0:
                    for done in chunks:
                        done.ref_cnt += 1
                    raise _not_unpinnable(key, chunk, keys)
                chunk.ref_cnt -= 1
                if chunk.ref_cnt == 0:
                    released.append(key)
                chunks.append(chunk)
            if released:
                self._state.num_evictable += len(released)
                self._policy.mark_evictable_many(released)  # type: ignore[attr-defined]
            return
        needed: dict[OffloadKey, int] = {}
        for key in keys:
            chunk = get(key)
            needed[key] = count = needed.get(key, 0) + 1
            if chunk is None or chunk.ref_cnt < count:
                raise _not_unpinnable(key, chunk, keys)
            chunks.append(chunk)
        # vLLM's order: each key's hook right after its ref count reaches 0.
        mark_evictable = self._policy.mark_evictable
        for key, chunk in zip(keys, chunks, strict=True):
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self._state.num_evictable += 1
                mark_evictable(key)
