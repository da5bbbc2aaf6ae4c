"""Per-request bookkeeping of which keys a request stored or reused (vLLM's ``cpu/manager.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from ._context import RequestContext
from ._errors import StoreError
from ._keys import GROUP_IDX_BYTES, OffloadKey

__all__ = ["RequestAccess", "RequestFinishedError", "access_state", "finished_key_groups"]


class RequestFinishedError(StoreError):
    """A request offered or loaded new keys after ``on_request_finished``."""


@dataclasses.dataclass(slots=True)
class RequestAccess:
    """Keys one request observed, grouped by KV-cache group in first-seen order."""

    owner: object
    generation: int
    key_groups: dict[int, list[OffloadKey]] = dataclasses.field(default_factory=dict)
    seen_keys: set[OffloadKey] = dataclasses.field(default_factory=set)
    inserted_keys: set[OffloadKey] = dataclasses.field(default_factory=set)
    reused_keys: set[OffloadKey] = dataclasses.field(default_factory=set)
    store_miss_keys: set[OffloadKey] = dataclasses.field(default_factory=set)
    finished: bool = False

    def check_open(self, keys: Iterable[OffloadKey], ctx: RequestContext) -> None:
        """Raises if the request finished and ``keys`` holds a key it has not seen."""
        if self.finished:
            for key in keys:
                if key not in self.seen_keys:
                    raise RequestFinishedError(
                        f"request {ctx.req_id!r} already finished "
                        f"(on_request_finished was called) but observed new key {key!r}; "
                        "use a new RequestContext per request."
                    )

    def record(
        self,
        keys: Iterable[OffloadKey],
        inserted: Sequence[OffloadKey] = (),
        reused: Sequence[OffloadKey] = (),
    ) -> None:
        """Records ``keys`` in prefix order, and which of them were inserted or reused."""
        seen, groups = self.seen_keys, self.key_groups
        for key in keys:
            if key in seen:
                continue
            group_idx = int.from_bytes(key[-GROUP_IDX_BYTES:], "big")
            group = groups.get(group_idx)
            if group is None:
                groups[group_idx] = [key]
            else:
                group.append(key)
            seen.add(key)
        self.inserted_keys.update(inserted)
        # Re-reading a chunk this request inserted is internal traffic, not a reuse.
        inserted_keys = self.inserted_keys
        self.reused_keys.update(key for key in reused if key not in inserted_keys)


def access_state(ctx: RequestContext, owner: object, generation: int) -> RequestAccess:
    """Returns ``owner``'s access state in ``ctx``, fresh if missing or stale."""
    state = ctx.get_state(RequestAccess)
    if state is None or state.owner is not owner or state.generation != generation:
        state = RequestAccess(owner, generation)
        ctx.set_state(state)
    return state


def finished_key_groups(
    state: RequestAccess, ctx: RequestContext
) -> tuple[tuple[OffloadKey, ...], ...]:
    """Returns the request's keys per group (ascending index), each head to tail.

    A group is sorted by recorded end positions when every key of it has one;
    otherwise it keeps first-seen order.
    """
    out = []
    for group_idx in sorted(state.key_groups):
        keys = state.key_groups[group_idx]
        positions = [ctx.get_key_position(key) for key in keys]
        if None not in positions:
            order = sorted(range(len(keys)), key=positions.__getitem__)
            keys = [keys[i] for i in order]
        out.append(tuple(keys))
    return tuple(out)
