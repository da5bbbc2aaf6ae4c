"""What the host store reports: its recorded events, counters and usage statistics.

`HostStore` owns one `StoreReporting` and delegates ``take_events``, ``counters`` and
``get_stats`` to it; it is given what it reads when built.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import TypeVar

from jax_kvoffload.config.internals import Medium

from ._errors import StoreTypeError
from ._events import OffloadingEvent
from ._keys import OffloadKey
from ._state import StoreState
from ._stats import StoreCounters, StoreStats

__all__ = ["StoreReporting"]

_E = TypeVar("_E")
_counter_values = operator.attrgetter(*(f.name for f in dataclasses.fields(StoreCounters)))


def _our_event(keys: tuple[OffloadKey, ...], removed: bool, metadata_only: bool) -> OffloadingEvent:
    return OffloadingEvent(keys, Medium.HOST, removed, metadata_only)


class StoreReporting:
    """``take_events`` / ``counters`` / ``get_stats`` of ``HostStore``.

    Args:
      get: The policy's ``get`` (a failed store's removal drops re-allocated keys).
      counters: The store's cumulative counters (read, never reset).
      state: The store's chunk accounting and the records drained here (events,
        allocation sizes, skipped stores).
      counts_skips: Whether a store threshold is set (``stores_skipped`` is None
        without one, as in vLLM).
    """

    def __init__(
        self,
        get: Callable[[OffloadKey], object],
        counters: StoreCounters,
        state: StoreState,
        counts_skips: bool,
    ) -> None:
        self._get = get
        self._counters = counters
        self._state = state
        self._counts_skips = counts_skips

    def take_events(
        self, make_event: Callable[[tuple[OffloadKey, ...], bool, bool], _E] | None = None
    ) -> list[_E]:
        """Returns and clears the recorded events, oldest first.

        A metadata-only removal drops the keys that were allocated again since (a
        retried store); it is left out when no key remains.

        Args:
          make_event: Builds each event from ``(keys, removed, metadata_only)``;
            default ``OffloadingEvent`` (the vLLM bridge builds vLLM's events).
        """
        if make_event is not None and not callable(make_event):
            raise StoreTypeError(
                f"make_event must be callable (keys, removed, metadata_only) -> event, "
                f"got {make_event!r}."
            )
        state = self._state
        if not state.events:
            return []
        events, state.events = state.events, []
        if make_event is None:
            make_event = _our_event  # type: ignore[assignment]
        get = self._get
        out = []
        for keys, removed, metadata_only in events:
            if metadata_only:
                keys = tuple([key for key in keys if get(key) is None])
                if not keys:
                    continue
            out.append(make_event(keys, removed, metadata_only))  # type: ignore[misc]
        return out

    def counters(self) -> StoreCounters:
        """Returns the cumulative counters (since construction; never drained)."""
        # Positional copy: dataclasses.replace costs ~4x as much (get_stats calls this
        # once per scheduler step).
        return StoreCounters(*_counter_values(self._counters))

    def get_stats(self) -> StoreStats:
        """Returns the usage gauges and counters, and drains the per-interval values."""
        state = self._state
        num_chunks = state.num_chunks
        occupied = state.num_allocated - len(state.free_list)
        if num_chunks > 0:
            usage = (occupied - state.num_evictable) / num_chunks
            write_usage = state.num_write_pending / num_chunks
            occupancy = occupied / num_chunks
        else:
            usage = write_usage = occupancy = 0.0
        sizes, state.allocation_sizes = tuple(state.allocation_sizes), []
        skipped = None
        if self._counts_skips:
            skipped, state.stores_skipped = state.stores_skipped, 0
        return StoreStats(
            cpu_cache_usage_perc=usage,
            cpu_cache_write_usage_perc=write_usage,
            cpu_cache_read_usage_perc=max(usage - write_usage, 0.0),
            cpu_allocation_size=sizes,
            stores_skipped=skipped,
            num_chunks=num_chunks,
            occupied_chunks=occupied,
            occupancy_perc=occupancy,
            counters=self.counters(),
        )
