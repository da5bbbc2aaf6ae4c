"""`JaxOffloadingSpec` with `secondary_tiers`, in real vLLM 0.33.0 on CPU (skipped
unless vLLM is importable).

The spec hands vLLM's own `TieringOffloadingManager` our store as primary tier, and the
tiers vLLM's factory builds from the same list. Engine A stores blocks of a torch KV
tensor through the manager and the worker; vLLM cascades the chunk rows into the tier.
Engine B, a fresh spec (another engine id: other host rows) on the same directory or
server, restarts empty: the lookup answers RETRY while the tier looks, HIT_PENDING while
it promotes, then HIT; the worker loads the promoted rows into B's tensor byte for byte.
"""

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
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from jax_kvoffload.bridge import vllm as bridge
from jax_kvoffload.config import ConfigFieldError
from tests.tiers._helpers import NO_REDIS, REDIS_SERVER, RedisServer

pytestmark = pytest.mark.vllm

WIDTH, BLOCKS, BPC = 512, 16, 2  # one KV tensor of 16 blocks of 512 bytes; 2 per chunk


def offloading_config(tiers, *, chunks=4, extra=None):
    row = WIDTH * BPC
    return vc.OffloadingConfig(
        groups=(vc.OffloadingGroupConfig(16, ("l0",), 0),),
        worker_kv_bytes_per_block=WIDTH,
        enable_kv_cache_events=True,
        extra_config={
            "spec_name": "JaxOffloadingSpec",
            "spec_module_path": "jax_kvoffload.bridge.vllm",
            "cpu_bytes_to_use": chunks * max(row, 4096),
            "secondary_tiers": tiers,
            **(extra or {}),
        },
        engine_id="jkv-spec-tiers-" + uuid.uuid4().hex[:10],
        model=vc.OffloadingModelConfig("m", "float16", 100),
        cache=vc.OffloadingCacheConfig(16, BPC),
        parallel=vc.OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )


class Engine:
    """One engine: the spec, its manager (scheduler) and worker over a torch tensor."""

    def __init__(self, tiers, seed):
        self.spec = OffloadingSpecFactory.create_spec(offloading_config(tiers))
        self.tensor = torch.randint(-128, 128, (BLOCKS, WIDTH), dtype=torch.int8,
                                    generator=torch.Generator().manual_seed(seed))  # fmt: skip
        kv = base.CanonicalKVCaches(
            [base.CanonicalKVCacheTensor(self.tensor, WIDTH)],
            [[base.CanonicalKVCacheRef(0, WIDTH)]],
        )
        self.manager = self.spec.get_manager()
        self.worker = self.spec.get_worker(kv)
        self.jobs = iter(range(1, 1000))

    def step(self):
        with self.manager.lock:
            self.manager.on_schedule_end(base.ScheduleEndContext((), ()))

    def transfer(self, submit, src, dst):
        job = next(self.jobs)
        assert submit(job, src, dst)
        self.worker.wait({job})
        (result,) = self.worker.get_finished()
        assert result.success
        return result

    def close(self):
        self.worker.shutdown()
        self.manager.shutdown()


def keys(n, seed=0):
    return [base.make_offload_key(f"{seed}:{i}".encode().ljust(32, b"."), 0) for i in range(n)]


@pytest.fixture(params=["disk", "redis"])
def tier(request, tmp_path):
    if request.param == "disk":
        yield {"type": "disk", "path": str(tmp_path / "tier"), "capacity_bytes": "64MiB"}
        return
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS)
    server = RedisServer()
    try:
        yield {"type": "redis", "url": server.url}
    finally:
        server.stop()


def test_the_manager_is_vllms_tiering_manager_over_our_store(tier):
    e = Engine([tier], seed=0)
    try:
        assert type(e.manager) is TieringOffloadingManager
        assert type(e.manager.primary_tier).__name__ == "JaxPrimaryTier"
        assert type(e.manager.secondary_tiers[0]).__name__ in ("JaxDiskTier", "JaxRedisTier")
        # vLLM's tiering metrics (and each tier's) are declared, as TieringOffloadingSpec's.
        extra = e.spec.extra_config
        names = set(bridge.JaxOffloadingSpec.build_metric_definitions(extra))
        assert "vllm:kv_offload_tiering_write_bytes" in names
        assert "tier" in bridge.JaxOffloadingSpec.config_info_keys(extra)
    finally:
        e.close()


def test_a_restarted_engine_serves_the_prefix_from_the_tier(tier):
    a = Engine([tier], seed=1)
    ks = keys(3)
    ctx = base.ReqContext("a")
    try:
        with a.manager.lock:
            a.manager.on_new_request(ctx)
            out = a.manager.prepare_store(ks, ctx)
        blocks = [4, 9, 1, 12, 7, 2]
        a.transfer(a.worker.submit_store, base.GPULoadStoreSpec(blocks, [6], [0]), out.store_spec)
        with a.manager.lock:
            a.manager.complete_store(out.keys_to_store, ctx)  # cascades to the tier
            a.manager.on_request_finished(ctx)
        deadline = time.monotonic() + 30
        while a.manager.has_pending_work():
            assert time.monotonic() < deadline, "the cascade did not finish"
            a.step()
            time.sleep(0.005)
        stored = a.tensor[blocks].clone()
    finally:
        a.close()

    b = Engine([tier], seed=2)  # a restart: empty host rows, another engine id
    ctx = base.ReqContext("b")
    try:
        with b.manager.lock:
            b.manager.on_new_request(ctx)
        seen = set()
        deadline = time.monotonic() + 30
        while True:
            with b.manager.lock:
                answers = [b.manager.lookup(k, ctx) for k in ks]
            seen.update(a.name for a in answers)
            if all(a is base.LookupResult.HIT for a in answers):
                break
            assert time.monotonic() < deadline, answers
            b.step()
            time.sleep(0.005)
        assert "RETRY" in seen or "HIT_PENDING" in seen  # it came from the tier
        with b.manager.lock:
            spec = b.manager.prepare_load(ks, ctx)
        targets = [0, 3, 5, 6, 10, 15]
        b.transfer(b.worker.submit_load, spec, base.GPULoadStoreSpec(targets, [6], [0]))
        with b.manager.lock:
            b.manager.complete_load(ks, ctx)
            b.manager.on_request_finished(ctx)
        assert torch.equal(b.tensor[targets], stored)
    finally:
        b.close()


def test_vllms_own_tier_types_are_accepted_too(tmp_path):
    # vLLM's "example" tier, next to ours: vLLM's factory builds both.
    tiers = [{"type": "example"}, {"type": "disk", "path": str(tmp_path / "t"),
                                   "capacity_bytes": "8MiB"}]  # fmt: skip
    e = Engine(tiers, seed=3)
    try:
        kinds = [type(t).__name__ for t in e.manager.secondary_tiers]
        assert kinds[1] == "JaxDiskTier" and kinds[0] != "JaxDiskTier"
    finally:
        e.close()


def test_without_tiers_the_manager_is_ours_and_with_a_threshold_tiers_are_refused(tmp_path):
    cfg = offloading_config(None)
    spec = bridge.JaxOffloadingSpec(cfg)
    assert type(spec.get_manager()).__name__ == "JaxOffloadingManager"
    tier = {"type": "disk", "path": str(tmp_path / "t"), "capacity_bytes": "8MiB"}
    spec = bridge.JaxOffloadingSpec(offloading_config([tier], extra={"store_threshold": 2}))
    with pytest.raises(ConfigFieldError, match="store_threshold"):
        spec.get_manager()
    theirs = offloading_config([{"type": "example"}], extra={"store_threshold": 2})
    with pytest.raises(ValueError, match="store_threshold"):  # vLLM refuses it too
        TieringOffloadingSpec(theirs).get_manager()
