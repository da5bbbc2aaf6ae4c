"""The eviction-policy contract, run on one registered policy (CONTRIBUTING.md, "Adding
an eviction policy"): the host store driven by random call sequences with the policy
inside, checked against the trivially correct model of `test_state_machine.py` (an
evicted key was idle, ready and not offered; pinned and write-pending keys are never
evicted; chunk ids unique and in range; lookups as the model says), plus the spelled-out
sequence that exposes a policy evicting a pinned chunk.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, run_state_machine_as_test

from ._helpers import K
from .test_state_machine import StoreMachine, _Fixed

__all__ = ["run_policy_contract"]


def run_policy_contract(policy: str, *, examples: int = 30, steps: int = 30) -> None:
    """Raises `AssertionError` (with a shrunk call sequence) where `policy` breaks it."""
    _pinned_key_sequence(policy)

    class OnePolicy(StoreMachine):
        @initialize(num_chunks=st.integers(1, 4), threshold=st.sampled_from([0, 0, 2]))
        def setup(self, num_chunks: int, threshold: int) -> None:
            StoreMachine.setup(self, num_chunks, policy, threshold)

    run_state_machine_as_test(
        OnePolicy,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,  # the docs' example policy is gone after its block
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


def _pinned_key_sequence(policy: str) -> None:
    machine = StoreMachine()
    StoreMachine.setup(machine, num_chunks=2, policy=policy, threshold=0)
    machine.store([K(1), K(2)], 3)
    machine.complete_store(_Fixed([K(1), K(2)]), True, False)
    machine.load(_Fixed([K(1)]), 3, 1)  # 1 is the oldest and pinned
    machine.store([K(3)], 3)  # must evict 2, never the pinned 1
    machine.lookups_match_the_model()
    machine.capacity_and_counters()
    machine.complete_load(0)
    machine.other("reset", [], 3)
    machine.capacity_and_counters()
    machine.teardown()
