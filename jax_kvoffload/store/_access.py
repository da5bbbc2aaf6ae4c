"""Per-request bookkeeping of which keys a request stored or reused (vLLM's ``cpu/manager.py``).

Mirrors vLLM 0.33.0's ``_RequestCacheAccess`` and ``_record_request_cache_access``
call for call: a policy sees ``on_request_access`` once per key and request (the
first time the request records it), and a key counts as inserted only once its
chunk was allocated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from ._context import AbstractRequestContext
from ._errors import StoreError
from ._keys import GROUP_IDX_BYTES, OffloadKey
from ._policy_base import RequestKeyGroups

__all__ = ["RequestAccess", "RequestFinishedError", "access_state", "finished_key_groups"]


class RequestFinishedError(StoreError):
    """A request offered or loaded new keys after ``on_request_finished``.

    vLLM asserts "New cache keys observed after request finalization" at the same
    point; the message starts with that text.
    """


@dataclasses.dataclass(slots=True)
class RequestAccess:
    """Keys one request observed, grouped by KV-cache group in first-seen order.

    Groups are keyed by the key's last 4 bytes (the big-endian group index), which
    sort as the indices do.
    """

    owner: object
    generation: int
    key_groups: dict[bytes, list[OffloadKey]] = dataclasses.field(default_factory=dict)
    seen_keys: set[OffloadKey] = dataclasses.field(default_factory=set)
    inserted_keys: set[OffloadKey] = dataclasses.field(default_factory=set)
    reused_keys: set[OffloadKey] = dataclasses.field(default_factory=set)
    store_miss_keys: set[OffloadKey] = dataclasses.field(default_factory=set)
    finished: bool = False

    def check_open(self, keys: Iterable[OffloadKey], ctx: AbstractRequestContext) -> None:
        """Raises if the request finished and ``keys`` holds a key it has not seen."""
        if self.finished:
            seen = self.seen_keys
            for key in keys:
                if key not in seen:
                    raise RequestFinishedError(
                        "New cache keys observed after request finalization: request "
                        f"{ctx.req_id!r} already finished (on_request_finished was "
                        f"called) but observed key {key!r}; use a new context per request."
                    )

    def record(self, keys: Iterable[OffloadKey], policy: object, ctx: object) -> None:
        """Records ``keys`` in prefix order; the policy observes the new ones.

        ``check_open`` must have passed for ``keys``.
        """
        seen, groups = self.seen_keys, self.key_groups
        new_keys = []
        for key in keys:
            if key in seen:
                continue
            tag = key[-GROUP_IDX_BYTES:]
            group = groups.get(tag)
            if group is None:
                groups[tag] = [key]
            else:
                group.append(key)
            seen.add(key)
            new_keys.append(key)
        if new_keys:
            policy.on_request_access(new_keys, ctx)  # type: ignore[attr-defined]

    def record_reused(self, keys: Iterable[OffloadKey]) -> None:
        """Counts ready ``keys`` as reused, unless this request inserted them."""
        # Re-reading a chunk this request inserted is internal traffic, not a reuse.
        inserted = self.inserted_keys
        if inserted:
            self.reused_keys.update(key for key in keys if key not in inserted)
        else:
            self.reused_keys.update(keys)


def access_state(ctx: AbstractRequestContext, owner: object, generation: int) -> RequestAccess:
    """Returns ``owner``'s access state in ``ctx``, fresh if missing or stale."""
    state = ctx.get_state(RequestAccess)
    if state is None or state.owner is not owner or state.generation != generation:
        state = RequestAccess(owner, generation)
        ctx.set_state(state)
    return state


def finished_key_groups(state: RequestAccess, ctx: AbstractRequestContext) -> RequestKeyGroups:
    """Returns the request's keys per group (ascending index), each head to tail.

    A group is sorted by recorded end positions when every key of it has one;
    otherwise it keeps first-seen order. The result also carries the order across
    groups that ``order_request_keys`` gives (vLLM's: by position when every key has
    one, else the groups concatenated), from the same position reads.
    """
    groups = []
    all_positions: dict[OffloadKey, int] | None = {}
    position_of = ctx.get_offload_key_position
    for tag in sorted(state.key_groups):
        keys: Sequence[OffloadKey] = state.key_groups[tag]
        positions = {}
        for key in keys:
            position = position_of(key)
            if position is None:
                all_positions = None
                break
            positions[key] = position
        else:
            keys = sorted(keys, key=positions.__getitem__)
            if all_positions is not None:
                all_positions.update(positions)
        groups.append(tuple(keys))
    out = RequestKeyGroups(groups)
    head_to_tail = [key for group in groups for key in group]
    if all_positions is not None and len(groups) > 1:
        head_to_tail.sort(key=all_positions.__getitem__)
    out.head_to_tail = head_to_tail
    return out
