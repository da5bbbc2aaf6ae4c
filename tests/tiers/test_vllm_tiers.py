"""Our tiers driven by vLLM 0.33.0's own `TieringOffloadingSpec` and tiering manager, on
CPU (skipped unless vLLM is importable).

Engine A stores chunks; vLLM cascades them from its CPU tier into ours. Engine B, a
fresh spec and primary tier on the same directory or server (a restart), looks the keys
up: vLLM's manager answers RETRY while our tier's async lookup runs, then HIT_PENDING
while it promotes, then HIT, and the primary rows hold exactly the stored bytes.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed")

import numpy as np
from vllm.v1.kv_offload import config as vc
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from jax_kvoffload.tiers import (
    DiskTierConfig,
    TierConfigError,
    parse_secondary_tiers,
)

from ._helpers import NO_REDIS, REDIS_SERVER, RedisServer
from ._mooncake import NO_MOONCAKE, MooncakeStore

pytestmark = pytest.mark.vllm

BRIDGE = "jax_kvoffload.bridge._vllm_tiers"
ROW = 8192  # worker_kv_bytes_per_block, one block per chunk, one worker


def make_spec(tier: dict, *, chunks: int = 4, events: bool = False):
    cfg = vc.OffloadingConfig(
        groups=(vc.OffloadingGroupConfig(16, ("l0",), 0),),
        worker_kv_bytes_per_block=ROW,
        enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": ROW * chunks, "secondary_tiers": [dict(tier)]},
        engine_id="jkv-tiers-" + uuid.uuid4().hex[:10],
        model=vc.OffloadingModelConfig("test-model", "bfloat16", 1024),
        cache=vc.OffloadingCacheConfig(16, 1),
        parallel=vc.OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )
    return TieringOffloadingSpec(cfg)


def rows(spec, manager) -> np.ndarray:
    view = manager.primary_tier.get_kv_memoryview()
    return np.frombuffer(view, dtype=np.uint8).reshape(spec.num_chunks, -1)


def step(manager) -> None:
    manager.on_schedule_end(ScheduleEndContext((), ()))


def store_through_vllm(tier: dict, keys, data) -> dict:
    """Engine A: stores `keys` into vLLM's CPU tier; vLLM cascades them to ours."""
    spec = make_spec(tier, events=True)
    m = spec.get_manager()
    try:
        r = rows(spec, m)
        ctx = ReqContext("a")
        with m.lock:
            m.on_new_request(ctx)
            out = m.prepare_store(keys, ctx)
            for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids):
                r[c] = data[k]
            m.complete_store(out.keys_to_store, ctx)
            m.on_request_finished(ctx)
        del r
        deadline = time.monotonic() + 30
        while m.has_pending_work():
            assert time.monotonic() < deadline, "cascade did not finish"
            with m.lock:
                step(m)
            time.sleep(0.005)
        ours = m.secondary_tiers[0]
        stats = ours.tier.stats()
        events = [e for e in m.take_events() if e.medium is Medium.STORAGE]
    finally:
        m.shutdown()
    return {"stats": stats, "events": events}


def settle(m, keys, ctx, limit_s: float = 30.0) -> list:
    """Looks `keys` up once per step until every answer is final (HIT or MISS)."""
    deadline = time.monotonic() + limit_s
    while True:
        with m.lock:
            res = [m.lookup(k, ctx) for k in keys]
            step(m)
        if all(r in (LookupResult.HIT, LookupResult.MISS) for r in res):
            return res
        assert time.monotonic() < deadline, res
        time.sleep(0.005)


def keys_and_data(n: int):
    rng = np.random.default_rng(n)
    keys = [make_offload_key(rng.bytes(32), 0) for _ in range(n)]
    return keys, {k: rng.integers(0, 256, ROW, dtype=np.uint8) for k in keys}


@pytest.fixture(params=["disk", "redis", "mooncake"])
def tier(request, tmp_path):
    if request.param == "mooncake":
        if NO_MOONCAKE is not None:
            pytest.skip(NO_MOONCAKE)
        store = MooncakeStore()
        try:
            yield {"type": "JaxMooncakeTier", "module_path": BRIDGE, **store.options(),
                   "enable_kv_events": True}  # fmt: skip
        finally:
            store.stop()
        return
    if request.param == "disk":
        yield {
            "type": "JaxDiskTier",
            "module_path": BRIDGE,
            "path": str(tmp_path / "t"),
            "capacity_bytes": "1GiB",
            "enable_kv_events": True,
        }
        return
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS)
    server = RedisServer()
    try:
        yield {
            "type": "JaxRedisTier",
            "module_path": BRIDGE,
            "url": server.url,
            "enable_kv_events": True,
        }
    finally:
        server.stop()


def test_vllms_factory_resolves_our_tiers():
    for name, source in (
        ("JaxDiskTier", CacheHitSource.DISK),
        ("JaxRedisTier", CacheHitSource.EXTERNAL_UNSPECIFIED),
        ("JaxMooncakeTier", CacheHitSource.EXTERNAL_UNSPECIFIED),
    ):
        cls = SecondaryTierFactory.get_tier_class({"type": name, "module_path": BRIDGE})
        assert issubclass(cls, SecondaryTierManager) and cls.__name__ == name
        assert cls.medium is Medium.STORAGE and cls.cache_hit_source is source


def test_a_restarted_engine_is_served_from_our_tier(tier):
    keys, data = keys_and_data(3)
    first = store_through_vllm(tier, keys, data)
    assert first["stats"].keys_stored == 3
    assert sorted(k for e in first["events"] for k in e.keys) == sorted(keys)
    parsed = parse_secondary_tiers([tier])[0]  # the same dict, typed by our parser
    assert parsed.type == tier["type"].removeprefix("Jax").removesuffix("Tier").lower()

    spec = make_spec(tier)
    m = spec.get_manager()
    try:
        ctx = ReqContext("b")
        with m.lock:
            m.on_new_request(ctx)
            assert [m.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 3
        assert settle(m, keys, ctx) == [LookupResult.HIT] * 3
        source = m.secondary_tiers[0].cache_hit_source
        with m.lock:
            assert [m.get_load_source(k, ctx) for k in keys] == [source] * 3
            load = m.prepare_load(keys, ctx)
        r = rows(spec, m)
        for k, c in zip(keys, load.chunk_ids):
            np.testing.assert_array_equal(r[c], data[k])
        del r
        with m.lock:
            m.complete_load(keys, ctx)
            m.on_request_finished(ctx)
        assert m.secondary_tiers[0].tier.stats().load_hits == 3
    finally:
        m.shutdown()


def test_a_damaged_entry_is_a_miss_in_vllm_never_wrong_bytes(tmp_path):
    tier = {
        "type": "JaxDiskTier",
        "module_path": BRIDGE,
        "path": str(tmp_path / "t"),
        "capacity_bytes": 1 << 30,
    }
    keys, data = keys_and_data(2)
    store_through_vllm(tier, keys, data)
    files = sorted(
        os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "t") for f in fs if f.endswith(".kv")
    )
    assert len(files) == 2
    for p in files[:1]:
        with open(p, "r+b") as f:
            f.seek(4096 + 7)
            f.write(b"\x5a\xa5")
    spec = make_spec(tier)
    m = spec.get_manager()
    try:
        ctx = ReqContext("b")
        with m.lock:
            m.on_new_request(ctx)
        res = settle(m, keys, ctx)
        assert sorted(r.name for r in res) == ["HIT", "MISS"]
        hit = [k for k, r in zip(keys, res) if r is LookupResult.HIT]
        with m.lock:
            load = m.prepare_load(hit, ctx)
        r = rows(spec, m)
        np.testing.assert_array_equal(r[load.chunk_ids[0]], data[hit[0]])
        del r
        with m.lock:
            m.complete_load(hit, ctx)
            m.on_request_finished(ctx)
        s = m.secondary_tiers[0].tier.stats()
        # One promotion job: the good chunk was kept from it (successful_keys), not re-read.
        assert (s.corrupt, s.loads_submitted, s.load_hits, s.load_misses) == (1, 1, 1, 1)
    finally:
        m.shutdown()


def test_a_bad_tier_option_fails_the_spec_with_our_error(tmp_path):
    spec = make_spec({"type": "JaxDiskTier", "module_path": BRIDGE, "path": str(tmp_path)})
    with pytest.raises(TierConfigError, match="capacity_bytes: is required"):
        spec.get_manager()
    assert isinstance(
        parse_secondary_tiers(
            [{"type": "JaxDiskTier", "module_path": BRIDGE, "path": "/p", "capacity_bytes": 1}]
        )[0],
        DiskTierConfig,
    )
