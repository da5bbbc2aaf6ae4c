"""What vLLM 0.33.0 code reads off a CPU offloading spec and manager, ours included.

vLLM's own offloading tests (tests/vllm_suite) found three gaps, each a name vLLM's code
or users read on `CPUOffloadingSpec` / `CPUOffloadingManager` and ours lacked:

- the spec's `cpu_page_size_per_worker` (vLLM's tiering spec sizes secondary-tier pages
  by it) and `cache_policy_module_path`: every public attribute vLLM's spec sets is
  compared here, value for value, on configs built with vLLM's classes;
- the manager's `medium` (its events carry it; vLLM's tier code reads `.medium`);
- vLLM's metrics feed the deprecated per-direction transfer series
  (`vllm:kv_offload_total_bytes`, `_total_time`, `_size`) only for subclasses of its
  `CPUOffloadingSpec`: with ours they stayed at zero.
"""

from __future__ import annotations

import itertools
import os

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed")

from prometheus_client import Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import metrics as vm
from vllm.v1.kv_offload import base
from vllm.v1.kv_offload import config as vc
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from jax_kvoffload.bridge import vllm as bridge

pytestmark = pytest.mark.vllm

OURS = {"spec_name": "JaxOffloadingSpec", "spec_module_path": "jax_kvoffload.bridge.vllm"}

# Public instance state of vLLM's CPUOffloadingManager that ours keeps inside the host
# store by design: mutable internals no vLLM code outside that class reads, and not part
# of `OffloadingManager` (the skipped stores and allocation sizes reach vLLM through
# `get_stats`, as vLLM's do). A new public name in vLLM's manager fails the test below.
MANAGER_INTERNALS = {
    "allocation_sizes_in_current_batch",
    "counts",
    "events",
    "max_tracker_size",
    "store_threshold",
    "stores_skipped_in_current_batch",
}


def offloading_config(extra, *, wkb, world, bpc, replicated=False, events=False):
    return vc.OffloadingConfig(
        groups=(vc.OffloadingGroupConfig(16, ("l0",), 0),),
        worker_kv_bytes_per_block=wkb,
        enable_kv_cache_events=events,
        extra_config=dict(extra),
        engine_id="engine0",
        model=vc.OffloadingModelConfig("m", "float16", 100),
        cache=vc.OffloadingCacheConfig(16, bpc),
        parallel=vc.OffloadingParallelConfig(0, world, world, 1, 1, 1, 0, 1, None, True),
        replicated_layout=replicated,
    )


def public_state(obj):
    return {k: v for k, v in vars(obj).items() if not k.startswith("_")}


CASES = list(
    itertools.product(
        (0, 1, 2, 4, 8),  # world size (0: a scheduler-only config)
        (0, 1000, 4096, 12_345),  # worker KV bytes per block
        (1, 3),  # blocks per chunk
        (False, True),  # replicated_layout
    )
)


@pytest.mark.parametrize(("world", "wkb", "bpc", "replicated"), CASES)
def test_every_public_attribute_of_vllms_cpu_spec_is_ours_with_its_value(
    world, wkb, bpc, replicated, monkeypatch
):
    # On CUDA vLLM's CPU spec maps one shared region, as ours always does, so the
    # replicated sizing agrees (on other hosts it differs by design: docs/vllm.md).
    monkeypatch.setattr(CPUOffloadingSpec, "_uses_shared_region", lambda self: True)
    extra = {
        **OURS,
        "cpu_bytes_to_use": 7 * 1024 * 1024 + 17,
        "eviction_policy": "arc",
        "cache_policy_module_path": None if wkb % 2 else "some.module",
    }
    cfg = offloading_config(extra, wkb=wkb, world=world, bpc=bpc, replicated=replicated)
    theirs = public_state(CPUOffloadingSpec(cfg))
    ours = public_state(bridge.JaxOffloadingSpec(cfg))
    missing = sorted(set(theirs) - set(ours))
    assert not missing, f"vLLM's CPU spec sets {missing}; ours does not"
    differ = {k: (ours[k], v) for k, v in theirs.items() if ours[k] != v}
    assert not differ, f"(ours, vLLM's): {differ}"
    assert theirs["cpu_page_size_per_worker"] == (wkb * bpc if world else 0)


def test_the_manager_has_vllms_medium_and_its_events_carry_it():
    extra = {**OURS, "cpu_bytes_to_use": 8 * 4096}
    cfg = offloading_config(extra, wkb=4096, world=1, bpc=1, events=True)
    theirs = CPUOffloadingSpec(cfg).get_manager()
    ours = bridge.JaxOffloadingSpec(cfg).get_manager()
    assert ours.medium is theirs.medium is base.Medium.CPU
    missing = set(public_state(theirs)) - set(public_state(ours))
    assert missing == MANAGER_INTERNALS, missing ^ MANAGER_INTERNALS
    key = base.make_offload_key(b"block-hash", 0)
    for manager in (ours, theirs):
        ctx = base.ReqContext("r")
        manager.prepare_store([key], ctx)
        manager.complete_store([key], ctx)
    (event,) = list(ours.take_events())
    assert event.medium is ours.medium
    assert [event] == list(theirs.take_events())


class _Metric:
    """A Prometheus metric stand-in: records what vLLM's metrics object feeds it."""

    def __init__(self, *args, **kwargs):
        self.increments, self.observed, self.values = [], [], []

    def labels(self, *labelvalues):
        return _Metric()

    def inc(self, value):
        self.increments.append(value)

    def observe(self, value):
        self.observed.append(value)

    def set(self, value):
        self.values.append(value)


class _VllmConfig:
    def __init__(self, extra):
        self.kv_transfer_config = type("T", (), {"kv_connector_extra_config": extra})()


def _deprecated_series(extra):
    """vLLM's `OffloadPromMetrics` for a spec, fed one store and one load payload."""
    prom = vm.OffloadPromMetrics(
        vllm_config=_VllmConfig(extra),
        metric_types={Gauge: _Metric, Counter: _Metric, Histogram: _Metric},
        labelnames=["model_name", "engine"],
        per_engine_labelvalues={0: ["model", "0"]},
    )
    stats = vm.OffloadingConnectorStats()
    for name, value in (
        (vm._TransferMetricName.LOAD_BYTES, 24),
        (vm._TransferMetricName.LOAD_TIME, 1.5),
        (vm._TransferMetricName.STORE_BYTES, 3),
        (vm._TransferMetricName.STORE_TIME, 0.25),
    ):
        stats.increase_counter(name, value)
    prom.observe(stats.data)
    return {
        (name, direction): getattr(prom, name)[(0, direction)].increments
        for name in ("counter_kv_bytes", "counter_kv_transfer_time")
        for direction in ("CPU_to_GPU", "GPU_to_CPU")
    }


def test_vllms_deprecated_transfer_series_count_for_our_spec_as_for_its_cpu_spec():
    theirs = _deprecated_series({"cpu_bytes_to_use": 4096})
    assert theirs[("counter_kv_bytes", "CPU_to_GPU")] == [24]  # the comparison is live
    assert _deprecated_series({**OURS, "cpu_bytes_to_use": 4096}) == theirs
    assert issubclass(bridge.JaxOffloadingSpec, CPUOffloadingSpec)
