"""`JaxOffloadingSpec` with a disk tier at TP=2 (skipped unless vLLM is importable): the
scheduler's tier stores and fills whole host rows of a region both workers map, each
worker's bytes in its own area (vLLM's `SharedOffloadRegion` layout). A restarted
engine promotes the rows from the tier and each rank loads exactly its own bytes."""

from __future__ import annotations

import os
import time
import uuid

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed")

import torch
from vllm.v1.kv_offload import base
from vllm.v1.kv_offload import config as vc
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

pytestmark = pytest.mark.vllm

WIDTH, BLOCKS, BPC, TP = 256, 8, 2, 2


def config(rank: int, engine_id: str, tier_dir: str) -> vc.OffloadingConfig:
    return vc.OffloadingConfig(
        groups=(vc.OffloadingGroupConfig(16, ("l0",), 0),),
        worker_kv_bytes_per_block=WIDTH,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "JaxOffloadingSpec",
            "spec_module_path": "jax_kvoffload.bridge.vllm",
            "cpu_bytes_to_use": 4 * 8192,
            "secondary_tiers": [{"type": "disk", "path": tier_dir, "capacity_bytes": "8MiB"}],
        },
        engine_id=engine_id,
        model=vc.OffloadingModelConfig("m", "float16", 100),
        cache=vc.OffloadingCacheConfig(16, BPC),
        parallel=vc.OffloadingParallelConfig(rank, TP, TP, 1, 1, 1, 0, 1, None, False),
    )


class Engine:
    """A scheduler spec (its manager) and one spec + worker per rank, one engine id."""

    def __init__(self, tier_dir: str, seed: int) -> None:
        engine_id = "jkv-tp-" + uuid.uuid4().hex[:10]
        self.manager = OffloadingSpecFactory.create_spec(
            config(0, engine_id, tier_dir)
        ).get_manager()
        self.tensors, self.workers = [], []
        for rank in range(TP):
            spec = OffloadingSpecFactory.create_spec(config(rank, engine_id, tier_dir))
            gen = torch.Generator().manual_seed(seed * 10 + rank)
            tensor = torch.randint(-128, 128, (BLOCKS, WIDTH), dtype=torch.int8, generator=gen)
            kv = base.CanonicalKVCaches(
                [base.CanonicalKVCacheTensor(tensor, WIDTH)], [[base.CanonicalKVCacheRef(0, WIDTH)]]
            )
            self.tensors.append(tensor)
            self.workers.append(spec.get_worker(kv))

    def step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(base.ScheduleEndContext((), ()))

    def transfer(self, job: int, direction: str, src, dst) -> None:
        for worker in self.workers:
            assert getattr(worker, f"submit_{direction}")(job, src, dst)
            worker.wait({job})
            assert [r.success for r in worker.get_finished()] == [True]

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.manager.shutdown()


def test_each_rank_loads_its_own_bytes_back_from_the_tier(tmp_path):
    keys = [base.make_offload_key(f"tp{i}".encode().ljust(32, b"."), 0) for i in range(2)]
    a = Engine(str(tmp_path / "tier"), seed=1)
    try:
        ctx = base.ReqContext("a")
        with a.manager.lock:
            a.manager.on_new_request(ctx)
            out = a.manager.prepare_store(keys, ctx)
        a.transfer(1, "store", base.GPULoadStoreSpec([0, 1, 2, 3], [4], [0]), out.store_spec)
        with a.manager.lock:
            a.manager.complete_store(out.keys_to_store, ctx)  # cascades whole rows
            a.manager.on_request_finished(ctx)
        deadline = time.monotonic() + 30
        while a.manager.has_pending_work():
            assert time.monotonic() < deadline, "the cascade did not finish"
            a.step()
            time.sleep(0.005)
        stored = [t[:4].clone() for t in a.tensors]
    finally:
        a.close()
    b = Engine(str(tmp_path / "tier"), seed=2)  # restarted: empty rows, other tensors
    try:
        ctx = base.ReqContext("b")
        with b.manager.lock:
            b.manager.on_new_request(ctx)
        deadline = time.monotonic() + 30
        while True:
            with b.manager.lock:
                answers = [b.manager.lookup(k, ctx) for k in keys]
            if all(x is base.LookupResult.HIT for x in answers):
                break
            assert time.monotonic() < deadline, answers
            b.step()
            time.sleep(0.005)
        with b.manager.lock:
            spec = b.manager.prepare_load(keys, ctx)
        b.transfer(2, "load", spec, base.GPULoadStoreSpec([4, 5, 6, 7], [4], [0]))
        for rank in range(TP):
            assert torch.equal(b.tensors[rank][4:8], stored[rank]), f"rank {rank}"
        assert not torch.equal(stored[0], stored[1])  # the ranks' bytes differ
    finally:
        b.close()
