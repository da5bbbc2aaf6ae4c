"""Eviction policies written for vLLM 0.33.0 plug into our manager as they do into vLLM's.

A policy class subclassing vLLM's `CachePolicy` is accepted through
`cache_policy_module_path`, and one registered with vLLM's `CachePolicyFactory` is
known by name; both then make the same decisions as under vLLM's manager. The CPU
spec's integer options are read as vLLM reads them, with typed errors for junk.
"""

from __future__ import annotations

import contextlib
import os

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed")

from vllm.v1.kv_offload import base
from vllm.v1.kv_offload import config as vc
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from jax_kvoffload.bridge import vllm as bridge
from jax_kvoffload.errors import KVOffloadTypeError, KVOffloadValueError

pytestmark = pytest.mark.vllm


class FIFOCachePolicy(CachePolicy):
    """A policy written against vLLM's interface only: evicts in insertion order."""

    def __init__(self, cache_capacity: int):
        super().__init__(cache_capacity)
        self.chunks: dict = {}

    def get(self, key):
        return self.chunks.get(key)

    def insert(self, key, chunk, req_context):
        self.chunks[key] = chunk

    def remove(self, key):
        del self.chunks[key]

    def touch(self, keys, req_context):
        return

    def evict(self, n, protected):
        victims = [k for k, c in self.chunks.items() if c.ref_cnt == 0 and k not in protected]
        if len(victims) < n:
            return None
        return [(k, self.chunks.pop(k)) for k in victims[:n]]

    def clear(self):
        self.chunks.clear()


with contextlib.suppress(ValueError):  # registered by an earlier import
    CachePolicyFactory.register_cache_policy("test-fifo", __name__, "FIFOCachePolicy")


def config(extra: dict) -> vc.OffloadingConfig:
    return vc.OffloadingConfig(
        groups=(vc.OffloadingGroupConfig(16, ("l0",), 0),),
        worker_kv_bytes_per_block=4096,
        enable_kv_cache_events=True,
        extra_config={
            "spec_name": "JaxOffloadingSpec",
            "spec_module_path": "jax_kvoffload.bridge.vllm",
            "cpu_bytes_to_use": 3 * 4096,
            **extra,
        },
        engine_id="e",
        model=vc.OffloadingModelConfig("m", "float16", 0),
        cache=vc.OffloadingCacheConfig(16, 1),
        parallel=vc.OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )


def key(i: int) -> bytes:
    return base.make_offload_key(i.to_bytes(8, "big"), 0)


def run_fifo_scenario(manager) -> list:
    """Stores 1, 2, 3 (full), touches 1, stores 4 and 5: FIFO evicts 1 then 2."""
    ctx = base.ReqContext("r")
    manager.on_new_request(ctx)
    answers = []
    for ids in ([1, 2, 3], [4], [5]):
        out = manager.prepare_store([key(i) for i in ids], ctx)
        answers.append((out.keys_to_store, out.store_spec.block_ids.tolist(), out.evicted_keys))
        manager.complete_store(out.keys_to_store, ctx)
        manager.touch([key(1)], ctx)
    return answers


@pytest.mark.parametrize(
    "extra",
    [
        {"eviction_policy": "FIFOCachePolicy", "cache_policy_module_path": __name__},
        {"eviction_policy": "test-fifo"},  # registered with vLLM's factory only
    ],
    ids=["module-path", "vllm-registered"],
)
def test_a_vllm_style_policy_plugs_in_and_decides_as_under_vllm(extra):
    cfg = config(extra)
    ours = bridge.JaxOffloadingSpec(cfg).get_manager()
    theirs = CPUOffloadingSpec(cfg).get_manager()
    assert type(ours.store.policy) is FIFOCachePolicy
    answers = run_fifo_scenario(ours)
    assert answers == run_fifo_scenario(theirs)
    assert [a[2] for a in answers] == [[], [key(1)], [key(2)]]


@pytest.mark.parametrize(
    ("extra", "tracking"),
    [
        ({"store_threshold": "2", "max_tracker_size": "10"}, True),
        ({"store_threshold": -3}, False),  # vLLM: below 2 is off
        ({"store_threshold": 2, "max_tracker_size": -1}, True),  # vLLM: tracks nothing
    ],
)
def test_integer_options_read_as_vllm_reads_them(extra, tracking):
    cfg = config(extra)
    ours = bridge.JaxOffloadingSpec(cfg).get_manager()
    theirs = CPUOffloadingSpec(cfg).get_manager()
    assert (ours.store._tracker is not None) == (theirs.counts is not None) == tracking
    ctx = [base.ReqContext("a"), base.ReqContext("b")]
    for _ in range(2):
        got = [
            m.prepare_store([key(1), key(2)], c).keys_to_store for m, c in zip((ours, theirs), ctx)
        ]
        assert got[0] == got[1]


@pytest.mark.parametrize(
    ("value", "error", "family"),
    [
        ("two", KVOffloadValueError, ValueError),
        ([2], KVOffloadTypeError, TypeError),
        ({"x": 1}, KVOffloadTypeError, TypeError),
    ],
)
def test_junk_integer_options_are_typed_errors_naming_the_key(value, error, family):
    spec = bridge.JaxOffloadingSpec(config({"store_threshold": value}))
    with pytest.raises(error, match="store_threshold"):
        spec.get_manager()
    with pytest.raises(family):  # vLLM raises the builtin of the same family
        CPUOffloadingSpec(config({"store_threshold": value})).get_manager()
