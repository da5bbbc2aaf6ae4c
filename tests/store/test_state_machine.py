"""Randomized call sequences checked against a trivially correct model.

The model keeps, per key, its chunk id, whether its store completed and how many
loads pin it. It predicts every lookup, which offers cannot be allocated, and checks
the manager's choices (evicted keys, chunk ids) against the safety rules: an evicted
key was idle, ready and not offered; pinned and write-pending keys are never evicted;
chunk ids are unique and within capacity; a failed store is never readable.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jax_kvoffload.store import (
    HostStore,
    KeyNotReadyError,
    KeyNotStoredError,
    LookupResult,
    RequestContext,
    RequestFinishedError,
)

from ._helpers import K

UNIVERSE = [K(i) for i in range(6)]
keys_st = st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=4)


def _draw_keys(data: st.DataObject, pool: list[bytes], any_key: bool) -> list[bytes]:
    """Keys from ``pool`` (calls that should succeed), or from anywhere."""
    source = UNIVERSE if any_key or not pool else pool
    return data.draw(st.lists(st.sampled_from(source), min_size=1, max_size=3))


class _Entry:
    __slots__ = ("chunk_id", "pins", "ready")

    def __init__(self, chunk_id: int) -> None:
        self.chunk_id, self.ready, self.pins = chunk_id, False, 0


class StoreMachine(RuleBasedStateMachine):
    @initialize(
        num_chunks=st.integers(1, 4),
        policy=st.sampled_from(["lru", "arc"]),
        threshold=st.sampled_from([0, 0, 2]),
    )
    def setup(self, num_chunks: int, policy: str, threshold: int) -> None:
        self.hs = HostStore(num_chunks, eviction_policy=policy, store_threshold=threshold)
        self.num_chunks = num_chunks
        self.entries: dict[bytes, _Entry] = {}
        self.stranded = 0  # chunks lost to duplicate keys in one offer (until reset)
        self.loads: list[list[bytes]] = []
        self.contexts = [RequestContext(f"r{i}") for i in range(3)]
        for i, ctx in enumerate(self.contexts):
            for j, key in enumerate(UNIVERSE):
                ctx.set_key_position(key, 16 * (j + i + 1))

    def _ctx(self, index: int) -> RequestContext | None:
        return None if index == 3 else self.contexts[index]

    @rule(
        op=st.sampled_from(
            ["store"] * 4
            + ["complete_store"] * 3
            + ["load"] * 3
            + ["complete_load"] * 3
            + ["touch"] * 2
            + ["finish"]
            + ["reset"]
        ),
        data=st.data(),
    )
    def step(self, op: str, data: st.DataObject) -> None:
        """One call; a weighted choice keeps loads and completions frequent, resets rare."""
        ctx_index = data.draw(st.integers(0, 3))
        if op == "store":
            self.store(data.draw(keys_st), ctx_index)
        elif op == "complete_store":
            self.complete_store(data, data.draw(st.booleans()), data.draw(st.integers(0, 3)) == 0)
        elif op == "load":
            self.load(data, ctx_index, data.draw(st.integers(0, 3)))
        elif op == "complete_load":
            self.complete_load(data.draw(st.integers(0, 100)))
        else:
            self.other(op, data.draw(keys_st), ctx_index)

    def store(self, keys: list[bytes], ctx_index: int) -> None:
        ctx = self._ctx(ctx_index)
        try:
            output = self.hs.prepare_store(keys, ctx)
        except RequestFinishedError:  # a finished context may not bring new keys
            return
        absent = [k for k in keys if k not in self.entries]
        idle = [
            k for k, e in self.entries.items() if e.ready and e.pins == 0 and k not in set(keys)
        ]
        free = self.num_chunks - len(self.entries) - self.stranded
        if output is None:
            # Only the unstored absent keys could have needed room.
            assert len(absent) - free > len(idle)
            return
        assert all(k in absent for k in output.keys_to_store)
        if self.hs._tracker is None:
            assert list(output.keys_to_store) == absent
        for key in output.evicted_keys:
            assert key in idle, "evicted a pinned, pending or offered key"
            del self.entries[key]
        assert len(output.evicted_keys) == max(0, len(output.keys_to_store) - free)
        in_use = {e.chunk_id for e in self.entries.values()}
        assert len(set(output.chunk_ids)) == len(output.chunk_ids)
        assert not in_use & set(output.chunk_ids)
        assert all(0 <= c < self.num_chunks for c in output.chunk_ids)
        for key, chunk_id in zip(output.keys_to_store, output.chunk_ids, strict=True):
            if key in self.entries:
                self.stranded += 1
            self.entries[key] = _Entry(chunk_id)

    def complete_store(self, data: st.DataObject, success: bool, any_key: bool) -> None:
        keys = _draw_keys(data, [k for k, e in self.entries.items() if not e.ready], any_key)
        self.hs.complete_store(keys, success)
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None and not entry.ready:
                if success:
                    entry.ready = True
                else:
                    del self.entries[key]

    def load(self, data: st.DataObject, ctx_index: int, any_key: int) -> None:
        # One load in four picks any key, so the error paths run too.
        keys = _draw_keys(data, [k for k, e in self.entries.items() if e.ready], any_key == 0)
        readable = all(k in self.entries and self.entries[k].ready for k in keys)
        try:
            chunk_ids = self.hs.prepare_load(keys, self._ctx(ctx_index))
        except (KeyNotStoredError, KeyNotReadyError):
            assert not readable
            return
        except RequestFinishedError:
            return
        assert readable
        assert list(chunk_ids) == [self.entries[k].chunk_id for k in keys]
        for key in keys:
            self.entries[key].pins += 1
        self.loads.append(keys)

    def complete_load(self, index: int) -> None:
        if not self.loads:
            return
        keys = self.loads.pop(index % len(self.loads))
        self.hs.complete_load(keys)
        for key in keys:
            self.entries[key].pins -= 1

    def other(self, op: str, keys: list[bytes], ctx_index: int) -> None:
        if op == "touch":
            self.hs.touch(keys, self._ctx(ctx_index))
        elif op == "finish" and ctx_index < 3:
            self.hs.on_request_finished(self.contexts[ctx_index])
            ctx = RequestContext(f"r{ctx_index}'")
            for j, key in enumerate(UNIVERSE):
                ctx.set_key_position(key, 16 * (j + 1))
            self.contexts[ctx_index] = ctx
        elif op == "reset":
            self.hs.reset_cache()
            self.entries.clear()
            self.loads.clear()
            self.stranded = 0

    @invariant()
    def lookups_match_the_model(self) -> None:
        for key in UNIVERSE:
            entry = self.entries.get(key)
            expected = (
                LookupResult.MISS
                if entry is None
                else LookupResult.HIT
                if entry.ready
                else LookupResult.HIT_PENDING
            )
            assert self.hs.lookup(key) is expected

    @invariant()
    def capacity_and_counters(self) -> None:
        store = self.hs
        used = len(self.entries) + self.stranded
        assert used + store.num_free_chunks == self.num_chunks
        idle = sum(1 for e in self.entries.values() if e.ready and e.pins == 0)
        pending = sum(1 for e in self.entries.values() if not e.ready)
        assert store.num_evictable_chunks == idle
        assert store.num_write_pending_chunks == pending + self.stranded
        assert len({e.chunk_id for e in self.entries.values()}) == len(self.entries)


StoreMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_store_machine = pytest.mark.slow(StoreMachine.TestCase)  # ~15 s on 2 idle cores


class _Fixed:
    """Stands in for ``st.data()``: every draw returns the given value."""

    def __init__(self, value: object) -> None:
        self.value = value

    def draw(self, strategy: object) -> object:
        return self.value


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_machine_pinned_key_sequence(policy):
    """The machine's checks, on the sequence that would expose an evicted pinned key.

    Random search reaches it only after a few hundred examples, more than the CI time
    budget allows, so it is spelled out here.
    """
    machine = StoreMachine()
    machine.setup(num_chunks=2, policy=policy, threshold=0)
    machine.store([K(1), K(2)], 3)
    machine.complete_store(_Fixed([K(1), K(2)]), True, False)
    machine.load(_Fixed([K(1)]), 3, 1)  # 1 is the least recent and pinned
    machine.store([K(3)], 3)  # must evict 2
    assert K(1) in machine.entries and K(2) not in machine.entries
    machine.lookups_match_the_model()
    machine.capacity_and_counters()
    machine.complete_load(0)
    machine.other("reset", [], 3)
    machine.capacity_and_counters()
    machine.teardown()
