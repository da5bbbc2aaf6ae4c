"""`JaxOffloadingSpec` with secondary tiers through vLLM 0.33.0's Prometheus path
(skipped unless vLLM and prometheus_client are importable).

vLLM builds one metric per name the spec declares and asserts that every name a
payload carries was declared (`OffloadPromMetrics.observe`). With tiers the manager is
vLLM's `TieringOffloadingManager`, whose payload includes our primary tier's own
`vllm:kv_offload_jax_*` metrics; the spec declared only vLLM's tiering names, so the
first `get_stats()` after a lookup made vLLM's metrics logger raise AssertionError at
every interval."""

from __future__ import annotations

import dataclasses
import os
import uuid

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed")
pytest.importorskip("prometheus_client")

import torch
from vllm.v1.kv_offload import base
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from tests.bridge.test_vllm_metrics import DEPRECATED, PAGE, Pipeline
from tests.bridge.test_vllm_spec import EXTRA, key, offloading_config

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("tier", ["example", "disk"])
def test_every_name_a_tiered_payload_carries_is_declared(tmp_path, tier):
    entry = {"type": "example"}
    if tier == "disk":
        entry = {"type": "disk", "path": str(tmp_path / "t"), "capacity_bytes": "8MiB"}
    extra = {**EXTRA, "cpu_bytes_to_use": 3 * 4096, "secondary_tiers": [entry]}
    cfg = offloading_config(extra, wkb=PAGE, bpc=2)
    cfg = dataclasses.replace(cfg, engine_id="tmetrics-" + uuid.uuid4().hex[:8])
    spec = OffloadingSpecFactory.create_spec(cfg)
    tensor = torch.randint(-128, 128, (12, PAGE), dtype=torch.int8)
    kv = base.CanonicalKVCaches(
        [base.CanonicalKVCacheTensor(tensor, PAGE)], [[base.CanonicalKVCacheRef(0, PAGE)]]
    )
    manager, worker = spec.get_manager(), spec.get_worker(kv)
    pipe = Pipeline(extra, manager, worker)
    ctx = base.ReqContext("r")
    try:
        with manager.lock:
            manager.on_new_request(ctx)
            answers = {manager.lookup(key(i), ctx).name for i in range(3)}
            assert answers <= {"MISS", "RETRY"}  # the disk tier looks in the background
            out = manager.prepare_store([key(0), key(1)], ctx)
        src = base.GPULoadStoreSpec([0, 1, 2, 3], [4], [0])
        assert worker.submit_store(1, src, out.store_spec)
        worker.wait({1})
        pipe.step()  # observes the payload: every name must be declared
        with manager.lock:
            manager.complete_store(out.keys_to_store, ctx)  # cascades into the tier
            assert manager.lookup(key(0), ctx).name == "HIT"
            manager.on_schedule_end(base.ScheduleEndContext(("r",), ()))
        pipe.step()
        before = pipe.samples()
        with manager.lock:
            manager.lookup(key(2), ctx)
        pipe.step()
        after = pipe.samples()
    finally:
        worker.shutdown()
        manager.shutdown()
    assert pipe.value("vllm:kv_offload_jax_chunk_lookups_total", result="hit") == 1
    assert pipe.value("vllm:kv_offload_jax_chunk_lookups_total", result="miss") >= 4
    assert pipe.value("vllm:kv_offload_jax_chunk_stores_total", result="completed") == 2
    for name, value in after.items():  # counters never go down
        if name[0].endswith("_total") and name in before:
            assert value >= before[name], name
    # The snapshot's store side is the primary tier's, hit tokens included (one group:
    # a chunk is 2 blocks of 16 tokens); it used to be None with tiers.
    stats = spec.stats()
    assert (stats.hits, stats.hit_tokens) == (1, 32)
    deprecated = [v for (n, _), v in after.items() if n.startswith(DEPRECATED)]
    # vLLM feeds its deprecated series for CPUOffloadingSpec subclasses; ours is declared
    # one (bridge/_vllm_metrics.declare_cpu_offloading), so they count as with vLLM's.
    assert deprecated and any(deprecated), "the deprecated series stayed at 0"
