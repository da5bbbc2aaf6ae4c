"""The plug-in's stats through vLLM 0.33.0's own metrics path, and its `stats()` snapshot.

vLLM's path is run for real: its connector worker (`OffloadingConnectorWorker.
get_finished`, `build_connector_worker_meta`) reads our worker's results, its
connector scheduler (`update_connector_output`, `get_stats`) joins them with the
manager's payload, and `KVConnectorProm` (the Prometheus logger's connector part) builds
the metrics from the spec's definitions and observes each payload. The two connector
objects are made without their constructors (those need a whole engine), with the few
attributes these methods read. The same manager script runs on vLLM's
`CPUOffloadingManager`, fed the same transfer results: every sample vLLM's CPU spec
exports must read the same with ours, except the deprecated series vLLM feeds only for
its own CPU spec.
"""

from __future__ import annotations

import functools
import os
import time
import types

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
vllm = pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed")
prometheus_client = pytest.importorskip("prometheus_client")

import torch  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: E402
    OffloadingConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (  # noqa: E402
    OffloadingConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (  # noqa: E402
    OffloadingConnectorWorker,
)
from vllm.v1.kv_offload import base  # noqa: E402
from vllm.v1.kv_offload import config as vc  # noqa: E402
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

from jax_kvoffload.stats import OffloadStats, TransferTotals  # noqa: E402
from tests.bridge.test_vllm_spec import EXTRA, key, offloading_config  # noqa: E402

pytestmark = pytest.mark.vllm

PAGE = 128  # bytes of one block of the one layer
TOKENS_PER_CHUNK = 2 * 16  # 2 blocks of 16 tokens (offloading_config's groups)
# vLLM feeds these transfer_type-labelled series only when the spec subclasses its CPU
# spec (OffloadPromMetrics._observe_deprecated_metrics); the flat names replace them.
DEPRECATED = ("vllm:kv_offload_total_bytes", "vllm:kv_offload_total_time", "vllm:kv_offload_size")


class Pipeline:
    """vLLM's stats path for one engine: connector worker -> scheduler -> Prometheus."""

    def __init__(self, extra: dict, manager, worker) -> None:
        self.registry = reg = prometheus_client.CollectorRegistry()

        class Prom(KVConnectorProm):  # vLLM's connector metrics, in a private registry
            _gauge_cls = functools.partial(prometheus_client.Gauge, registry=reg)
            _counter_cls = functools.partial(prometheus_client.Counter, registry=reg)
            _histogram_cls = functools.partial(prometheus_client.Histogram, registry=reg)

        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )
        self.prom = Prom(types.SimpleNamespace(kv_transfer_config=transfer), ["engine"], {0: ["0"]})
        self.scheduler = OffloadingConnectorScheduler.__new__(OffloadingConnectorScheduler)
        vars(self.scheduler).update(
            manager=manager,
            _connector_stats=OffloadingConnectorStats(),
            _info_sent=False,
            _step_region=None,
            _jobs={},
            _reset_fence={},
            # Job completions are the scheduler's request bookkeeping, not metrics:
            # every reported id is "stale" here, so that bookkeeping is skipped.
            _stale_job_threshold=1 << 62,
        )
        self.worker = OffloadingConnectorWorker.__new__(OffloadingConnectorWorker)
        vars(self.worker).update(
            worker=worker, _load_jobs={}, _connector_worker_meta=OffloadingWorkerMetadata()
        )

    def step(self, loads: tuple[int, ...] = ()) -> None:
        """One engine step: collect finished jobs, report, observe the payload."""
        self.worker._load_jobs.update(dict.fromkeys(loads, "r"))
        OffloadingConnectorWorker.get_finished(self.worker, set())
        meta = self.worker.build_connector_worker_meta()
        self.scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))
        stats = self.scheduler.get_stats()
        if stats is not None:
            self.prom.observe(stats.data, 0)

    def samples(self) -> dict[tuple[str, tuple], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for metric in self.registry.collect()
            for s in metric.samples
            if not s.name.endswith("_created")  # creation timestamps
        }

    def value(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, {"engine": "0", **labels})


class Replay:
    """A worker for vLLM's manager twin: reports the results ours reported."""

    def __init__(self) -> None:
        self.results: list = []

    def get_finished(self) -> list:
        out, self.results = self.results, []
        return out


class Both:
    """Our plug-in (manager and worker over CPU tensors) and vLLM's CPU manager twin."""

    def __init__(self, num_chunks: int = 3) -> None:
        extra = {**EXTRA, "cpu_bytes_to_use": num_chunks * 4096}
        self.spec = OffloadingSpecFactory.create_spec(offloading_config(extra, wkb=PAGE, bpc=2))
        self.tensor = torch.randint(-128, 128, (12, PAGE), dtype=torch.int8)
        kv = base.CanonicalKVCaches(
            [base.CanonicalKVCacheTensor(self.tensor, PAGE)], [[base.CanonicalKVCacheRef(0, PAGE)]]
        )
        self.ours, self.worker = self.spec.get_manager(), self.spec.get_worker(kv)
        cpu_extra = {"cpu_bytes_to_use": extra["cpu_bytes_to_use"]}  # vLLM's default spec
        self.theirs = CPUOffloadingSpec(offloading_config(cpu_extra, wkb=PAGE, bpc=2)).get_manager()
        self.replay = Replay()
        self.pipes = [
            Pipeline(extra, self.ours, self.worker),
            Pipeline(cpu_extra, self.theirs, self.replay),
        ]
        self.ctx = [base.ReqContext("r"), base.ReqContext("r")]
        self.ours.on_new_request(self.ctx[0])
        self.theirs.on_new_request(self.ctx[1])

    def call(self, method: str, *args, **kw):
        answers = []
        for manager, ctx in zip((self.ours, self.theirs), self.ctx):
            out = getattr(manager, method)(*args, ctx, **kw)
            if isinstance(out, base.PrepareStoreOutput):
                out = (out.keys_to_store, out.store_spec.block_ids.tolist(), out.evicted_keys)
            elif isinstance(out, base.LoadStoreSpec):
                out = out.block_ids.tolist()
            answers.append(out)
        assert answers[0] == answers[1], (method, args, answers)
        return answers[0]

    def lookups(self, ids) -> list[str]:
        return [self.call("lookup", key(i)).name for i in ids]

    def step(self, loads: tuple[int, ...] = ()) -> list:
        """Collects our worker's results, hands the same to the twin, runs both paths."""
        results = self.worker.get_finished()
        self.worker._ready = list(results)  # reported again to vLLM's connector worker
        self.replay.results = list(results)
        for pipe in self.pipes:
            pipe.step(loads)
        return results


def test_a_scripted_scenario_reaches_vllms_metrics_and_the_snapshot(monkeypatch):
    b = Both()  # 3 chunks of 2 blocks of 128 bytes
    # 1. Store keys 0-2 (blocks 0-5). A lookup while the store is pending: HIT_PENDING.
    out = b.call("prepare_store", [key(0), key(1), key(2)])
    assert out == ([key(0), key(1), key(2)], [0, 1, 2], [])
    assert b.worker.submit_store(
        1, base.GPULoadStoreSpec(list(range(6)), [6], [0]), _cpu_spec(out[1])
    )
    b.worker.wait({1})
    assert b.lookups([0]) == ["HIT_PENDING"]
    (r_store,) = b.step()
    b.call("complete_store", [key(0), key(1), key(2)])
    # 2. Five lookups, two hits.
    assert b.lookups([0, 1, 3, 4, 5]) == ["HIT", "HIT", "MISS", "MISS", "MISS"]
    # 3. Load keys 0 and 1 into blocks 6-9.
    assert b.call("prepare_load", [key(0), key(1)]) == [0, 1]
    assert b.worker.submit_load(2, _cpu_spec([0, 1]), base.GPULoadStoreSpec([6, 7, 8, 9], [4], [0]))
    b.worker.wait({2})
    (r_load,) = b.step(loads=(2,))
    b.call("complete_load", [key(0), key(1)])
    assert torch.equal(b.tensor[6:10], b.tensor[0:4])
    # 4. Touch 0 and 1: 2 is now the oldest, and storing 3 evicts it. The store job
    # fails (injected); vLLM's connector does not take failed jobs (it asserts), so
    # this result stays out of its path and the manager is told the store failed.
    b.call("touch", [key(0), key(1)])
    assert b.call("prepare_store", [key(3)]) == ([key(3)], [2], [key(2)])

    def boom(*args, **kwargs):
        raise MemoryError("host memory exhausted")

    monkeypatch.setattr(b.worker.pool, "write_blocks", boom)
    assert b.worker.submit_store(3, base.GPULoadStoreSpec([10, 11], [2], [0]), _cpu_spec([2]))
    b.worker.wait({3})
    (r_failed,) = b.worker.get_finished()
    assert not r_failed.success
    b.call("complete_store", [key(3)], success=False)
    # 5. Pin 0 and 1 with a load: storing two new keys finds one free chunk, no more.
    b.call("prepare_load", [key(0), key(1)])
    assert b.call("prepare_store", [key(6), key(7)]) is None
    b.call("complete_load", [key(0), key(1)])
    b.step()
    ours, theirs = b.pipes
    assert ours.value("vllm:kv_offload_jax_occupancy_perc") == 2 / 3
    assert ours.value("vllm:kv_offload_cpu_cache_usage_perc") == 0.0  # nothing pinned now
    # 6. Reset.
    b.ours.reset_cache()
    b.theirs.reset_cache()
    b.step()

    assert (r_store.transfer_size, r_load.transfer_size) == (6 * PAGE, 4 * PAGE)
    assert b.spec.stats() == OffloadStats(
        lookups=1 + 5,
        hits=2,
        hits_pending=1,
        misses=3,
        hit_tokens=2 * TOKENS_PER_CHUNK,
        prefix_lookups=None,
        prefix_hit_tokens=None,
        store=TransferTotals(1, 1, 6 * PAGE, r_store.transfer_time),
        load=TransferTotals(1, 0, 4 * PAGE, r_load.transfer_time),
        stores_completed=3,
        stores_failed=1,
        stores_dropped=1,
        evictions=1,
        resets=1,
        num_chunks=3,
    )

    # vLLM's own names, read from Prometheus.
    assert ours.value("vllm:kv_offload_store_bytes_total") == 6 * PAGE
    assert ours.value("vllm:kv_offload_load_bytes_total") == 4 * PAGE
    assert ours.value("vllm:kv_offload_store_time_total") == r_store.transfer_time
    assert ours.value("vllm:kv_offload_load_time_total") == r_load.transfer_time
    assert ours.value("vllm:kv_offload_store_size_count") == 1
    # prepare_store asked for 3, 1 and 2 chunks (the last attempt failed: still observed).
    assert ours.value("vllm:kv_offload_cpu_allocation_size_count") == 3
    assert ours.value("vllm:kv_offload_cpu_allocation_size_sum") == 6
    # Ours.
    lookups = {r: ours.value("vllm:kv_offload_jax_chunk_lookups_total", result=r) for r in
               ("hit", "hit_pending", "miss")}  # fmt: skip
    assert lookups == {"hit": 2, "hit_pending": 1, "miss": 3}
    assert ours.value("vllm:kv_offload_jax_chunk_stores_total", result="completed") == 3
    assert ours.value("vllm:kv_offload_jax_chunk_stores_total", result="failed") == 1
    assert ours.value("vllm:kv_offload_jax_chunk_evictions_total") == 1
    assert ours.value("vllm:kv_offload_jax_occupancy_perc") == 0.0  # after the reset

    # Every sample vLLM's CPU spec exports reads the same with ours, the deprecated
    # per-direction series included (vLLM feeds them for CPUOffloadingSpec subclasses).
    mine, vllms = ours.samples(), theirs.samples()
    differ = {k: (mine.get(k), v) for k, v in vllms.items() if mine.get(k) != v}
    assert not differ
    assert ours.value("vllm:kv_offload_total_bytes_total", transfer_type="GPU_to_CPU") == 6 * PAGE
    assert {name for name, _ in mine} - {name for name, _ in vllms} == {
        "vllm:kv_offload_jax_occupancy_perc",
        "vllm:kv_offload_jax_chunk_lookups_total",
        "vllm:kv_offload_jax_chunk_stores_total",
        "vllm:kv_offload_jax_chunk_evictions_total",
    }
    b.worker.shutdown()


def _cpu_spec(chunk_ids):
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    return CPULoadStoreSpec(chunk_ids)


def test_counters_are_sent_as_increments_and_only_when_they_moved():
    spec = OffloadingSpecFactory.create_spec(offloading_config(wkb=PAGE))
    manager, ctx = spec.get_manager(), base.ReqContext("r")
    manager.on_new_request(ctx)
    manager.lookup(key(1), ctx)
    first = manager.get_stats().data["data"]
    assert first["vllm:kv_offload_jax_chunk_lookups"] == {("miss",): 1}
    second = manager.get_stats().data["data"]
    assert "vllm:kv_offload_jax_chunk_lookups" not in second  # nothing new
    manager.lookup(key(1), ctx)
    manager.lookup(key(2), ctx)
    assert manager.get_stats().data["data"]["vllm:kv_offload_jax_chunk_lookups"] == {("miss",): 2}
    # offload_stats() drains nothing: vLLM's next payload still carries its increments.
    manager.lookup(key(3), ctx)
    assert manager.offload_stats().misses == 4
    assert manager.get_stats().data["data"]["vllm:kv_offload_jax_chunk_lookups"] == {("miss",): 1}


def test_a_worker_only_spec_reports_its_transfers_and_mixed_groups_no_hit_tokens():
    cfg = offloading_config(wkb=PAGE)
    spec = bridge_spec(cfg)
    tensor = torch.zeros((4, PAGE), dtype=torch.int8)
    kv = base.CanonicalKVCaches(
        [base.CanonicalKVCacheTensor(tensor, PAGE)], [[base.CanonicalKVCacheRef(0, PAGE)]]
    )
    worker = spec.get_worker(kv)
    assert worker.submit_store(1, base.GPULoadStoreSpec([0], [1], [0]), _cpu_spec([0]))
    worker.wait({1})
    (result,) = worker.get_finished()
    stats = spec.stats()
    assert stats == OffloadStats(
        num_chunks=spec.num_chunks,
        hit_tokens=0,
        store=TransferTotals(1, 0, PAGE, result.transfer_time),
    )
    assert worker.transfer_totals() == (stats.store, TransferTotals())
    worker.shutdown()
    # Groups of 16 and 32 tokens per block: a key does not say its group, so no tokens.
    mixed = vc.OffloadingConfig(
        groups=(vc.OffloadingGroupConfig(16, ("a",), 0), vc.OffloadingGroupConfig(32, ("b",), 1)),
        worker_kv_bytes_per_block=PAGE,
        enable_kv_cache_events=False,
        extra_config=dict(EXTRA),
        engine_id="e",
        model=vc.OffloadingModelConfig("m", "float16", 100),
        cache=vc.OffloadingCacheConfig(16, 1),
        parallel=vc.OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )
    mixed_spec = bridge_spec(mixed)
    assert mixed_spec.stats().hit_tokens is None
    assert mixed_spec.get_manager().offload_stats().hit_tokens is None


def bridge_spec(cfg):
    return OffloadingSpecFactory.create_spec(cfg)


def test_transfer_time_is_the_jobs_own_not_the_wait_until_it_is_collected():
    spec = bridge_spec(offloading_config(wkb=PAGE))
    tensor = torch.zeros((4, PAGE), dtype=torch.int8)
    kv = base.CanonicalKVCaches(
        [base.CanonicalKVCacheTensor(tensor, PAGE)], [[base.CanonicalKVCacheRef(0, PAGE)]]
    )
    worker = spec.get_worker(kv)
    try:
        assert worker.submit_store(1, base.GPULoadStoreSpec([0], [1], [0]), _cpu_spec([0]))
        worker.wait({1})
        time.sleep(1.0)  # vLLM collects once per engine step; this step was slow
        (result,) = worker.get_finished()
    finally:
        worker.shutdown()
    # A 128-byte copy: far below the second it waited to be collected.
    assert 0 < result.transfer_time < 1.0
