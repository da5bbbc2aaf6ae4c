"""Per-request bookkeeping of which keys a request stored or reused (vLLM's ``cpu/manager.py``).

Mirrors vLLM 0.33.0's ``_RequestCacheAccess`` and ``_record_request_cache_access``
call for call: a policy sees ``on_request_access`` once per key and request (the
first time the request records it), and a key counts as inserted only once its
chunk was allocated.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from collections.abc import Iterable, Sequence
from typing import cast

from ._context import AbstractRequestContext, position_reader
from ._errors import StoreError
from ._keys import GROUP_IDX_BYTES, OffloadKey
from ._policy_base import RequestKeyGroups

__all__ = ["RequestAccess", "RequestFinishedError", "access_state", "finished_key_groups"]

_group_tag = operator.itemgetter(slice(-GROUP_IDX_BYTES, None))  # the group index bytes


class RequestFinishedError(StoreError):
    """A request offered or loaded new keys after ``on_request_finished``.

    vLLM asserts "New cache keys observed after request finalization" at the same
    point; the message starts with that text.
    """


@dataclasses.dataclass(slots=True)
class RequestAccess:
    """Keys one request observed, in first-seen order, and how it used them.

    ``seen`` is an insertion-ordered dict (values unused): recording a batch is one
    C-level ``update``, and the keys are grouped by KV-cache group only once, when
    the request finishes (vLLM groups them as it records them: the same groups, in
    the same first-seen order within each group).
    """

    owner: object
    generation: int
    seen: dict[OffloadKey, None] = dataclasses.field(default_factory=dict)
    inserted_keys: set[OffloadKey] = dataclasses.field(default_factory=set)
    reused_keys: set[OffloadKey] = dataclasses.field(default_factory=set)
    store_miss_keys: set[OffloadKey] = dataclasses.field(default_factory=set)
    finished: bool = False

    def check_open(self, keys: Iterable[OffloadKey], ctx: AbstractRequestContext) -> None:
        """Raises if the request finished and ``keys`` holds a key it has not seen."""
        if self.finished:
            seen = self.seen
            for key in keys:
                if key not in seen:
                    raise RequestFinishedError(
                        "New cache keys observed after request finalization: request "
                        f"{ctx.req_id!r} already finished (on_request_finished was "
                        f"called) but observed key {key!r}; use a new context per request."
                    )

    def record(self, keys: Sequence[OffloadKey], policy: object, ctx: object) -> None:
        """Records ``keys`` in prefix order; the policy observes the new ones.

        ``check_open`` must have passed for ``keys``.
        """
        seen = self.seen
        num_seen = len(seen)
        # dict.fromkeys drops repeats within the batch; update skips keys already seen
        # and appends the new ones in order, so the tail of `seen` is the new keys.
        seen.update(dict.fromkeys(keys))
        if len(seen) != num_seen:
            new_keys = list(itertools.islice(seen, num_seen, None))
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


def _by_group(keys: list[OffloadKey]) -> list[list[OffloadKey]]:
    """``keys`` split by group index (ascending), first-seen order kept in each."""
    if len(set(map(_group_tag, keys))) <= 1:  # one group: the common case, in C
        return [keys] if keys else []
    groups: dict[bytes, list[OffloadKey]] = {}
    for key in keys:
        tag = key[-GROUP_IDX_BYTES:]
        group = groups.get(tag)
        if group is None:
            groups[tag] = [key]
        else:
            group.append(key)
    # The tags are big-endian indices: as bytes they sort as the indices do.
    return [groups[tag] for tag in sorted(groups)]


def finished_key_groups(state: RequestAccess, ctx: AbstractRequestContext) -> RequestKeyGroups:
    """Returns the request's keys per group (ascending index), each head to tail.

    A group is sorted by recorded end positions when every key of it has one;
    otherwise it keeps first-seen order. The result also carries the order across
    groups that ``order_request_keys`` gives (vLLM's: by position when every key has
    one, else the groups concatenated), from the same position reads.
    """
    groups = []
    all_positions: dict[OffloadKey, int] | None = {}
    position_of = position_reader(ctx)
    by_group = _by_group(list(state.seen))
    for keys in by_group:
        found = list(map(position_of, keys))
        if None in found:
            all_positions = None
        else:
            known = cast("list[int]", found)
            if all_positions is not None and len(by_group) > 1:
                all_positions.update(zip(keys, known, strict=True))
            # Keys are usually recorded in prefix order already: then the stable sort
            # by position would leave them as they are (sorting the ints is cheap).
            if known != sorted(known):
                positions = dict(zip(keys, known, strict=True))
                keys = sorted(keys, key=positions.__getitem__)
        groups.append(tuple(keys))
    out = RequestKeyGroups(groups)
    if len(groups) == 1:
        head_to_tail = list(groups[0])
    else:
        head_to_tail = [key for group in groups for key in group]
        if all_positions is not None:
            head_to_tail.sort(key=all_positions.__getitem__)
    out.head_to_tail = head_to_tail
    return out
