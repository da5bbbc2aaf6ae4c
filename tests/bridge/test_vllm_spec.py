"""`JaxOffloadingSpec` inside real vLLM 0.33.0 (skipped unless vLLM is importable).

vLLM's factory loads the spec from the extra config of docs/vllm.md; the manager is run
side by side with vLLM's own `CPUOffloadingManager` on the narrated scenarios of the
reference tests (G1, G3, G5) and must answer identically; a store then load through
vLLM's specs and `CanonicalKVCaches` reproduces the bytes.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
vllm = pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed")

import torch  # noqa: E402
from vllm.v1.kv_offload import base  # noqa: E402
from vllm.v1.kv_offload import config as vc  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from jax_kvoffload.bridge import vllm as bridge  # noqa: E402
from jax_kvoffload.store import CapacityError  # noqa: E402

pytestmark = pytest.mark.vllm

OURS = "vllm:kv_offload_jax_"  # the prefix of the plug-in's own metrics

EXTRA = {
    "spec_name": "JaxOffloadingSpec",
    "spec_module_path": "jax_kvoffload.bridge.vllm",
    "cpu_bytes_to_use": 8000000000,
}


def offloading_config(extra=None, *, wkb=1000, world=1, bpc=1, groups=1, events=True, **kw):
    return vc.OffloadingConfig(
        groups=tuple(vc.OffloadingGroupConfig(16, (f"l{g}",), g) for g in range(groups)),
        worker_kv_bytes_per_block=wkb,
        enable_kv_cache_events=events,
        extra_config=dict(EXTRA if extra is None else extra),
        engine_id="engine0",
        model=vc.OffloadingModelConfig("m", "float16", 100),
        cache=vc.OffloadingCacheConfig(16, bpc),
        parallel=vc.OffloadingParallelConfig(0, world, world, 1, 1, 1, 0, 1, None, True),
        **kw,
    )


def test_vllms_factory_loads_the_spec_from_the_extra_config():
    spec = OffloadingSpecFactory.create_spec(offloading_config())
    assert type(spec) is bridge.JaxOffloadingSpec
    assert issubclass(bridge.JaxOffloadingSpec, base.OffloadingSpec)
    assert isinstance(spec.get_manager(), base.OffloadingManager)
    assert spec.get_manager() is spec.get_manager()


@pytest.mark.parametrize(
    ("extra", "wkb", "world", "bpc"),
    [
        ({"cpu_bytes_to_use": 10 * 4096}, 1000, 2, 3),  # F2: 5 chunks of 8192 bytes
        ({"cpu_bytes_to_use": "40960"}, 4096, 1, 1),  # F3: a string budget
        ({"cpu_bytes_to_use": 4096}, 0, 1, 1),  # F3: no KV bytes, no chunks
        ({"cpu_bytes_to_use": 10**6, "store_threshold": 2}, 300, 1, 2),
    ],
)
def test_sizing_metrics_and_config_info_match_vllms_cpu_spec(extra, wkb, world, bpc):
    cfg = offloading_config({**EXTRA, **extra}, wkb=wkb, world=world, bpc=bpc)
    ours, theirs = bridge.JaxOffloadingSpec(cfg), CPUOffloadingSpec(cfg)
    assert (ours.num_chunks, ours.kv_bytes_per_chunk) == (
        theirs.num_chunks,
        theirs.kv_bytes_per_chunk,
    )
    assert ours.get_manager().config_info() == theirs.get_manager().config_info()
    extra_config = cfg.extra_config
    # vLLM's CPU-spec metrics, identical, then ours (tests/bridge/test_vllm_metrics.py).
    theirs_defs = CPUOffloadingSpec.build_metric_definitions(extra_config)
    ours_defs = bridge.JaxOffloadingSpec.build_metric_definitions(extra_config)
    assert dict(list(ours_defs.items())[: len(theirs_defs)]) == theirs_defs
    assert all(name.startswith(OURS) for name in list(ours_defs)[len(theirs_defs) :])
    assert bridge.JaxOffloadingSpec.config_info_keys(extra_config) == (
        CPUOffloadingSpec.config_info_keys(extra_config)
    )


@pytest.mark.parametrize("world", [2, 4, 8])
def test_replicated_layout_follows_vllms_shared_region_gate(world, monkeypatch):
    # vLLM keeps one host copy of replicated (MLA) pages only where the workers' host
    # buffer is one shared region (`replicated_layout and _uses_shared_region()`). Ours
    # always is (a SharedHostRegion on every platform), as vLLM's tiering spec's is.
    cfg = offloading_config(
        {**EXTRA, "cpu_bytes_to_use": 2 * 4096 * world},
        wkb=4096,
        world=world,
        replicated_layout=True,
    )

    def sizing(spec):
        return spec.replicated_layout, spec.kv_bytes_per_chunk, spec.num_chunks

    one_copy = (True, 4096, 2 * world)
    assert sizing(bridge.JaxOffloadingSpec(cfg)) == one_copy
    assert sizing(TieringOffloadingSpec(cfg)) == one_copy
    # vLLM's CPU spec maps its region only on CUDA-alike/XPU hosts: on this CPU host it
    # keeps a private buffer per rank and so a copy per rank; on CUDA it answers as ours.
    assert sizing(CPUOffloadingSpec(cfg)) == (False, 4096 * world, 2)
    monkeypatch.setattr(CPUOffloadingSpec, "_uses_shared_region", lambda self: True)
    assert sizing(CPUOffloadingSpec(cfg)) == one_copy
    # Without the flag every spec sizes a copy per rank.
    plain = offloading_config(
        {**EXTRA, "cpu_bytes_to_use": 2 * 4096 * world}, wkb=4096, world=world
    )
    assert sizing(bridge.JaxOffloadingSpec(plain)) == (False, 4096 * world, 2)


def test_a_replicated_worker_without_its_shared_region_fails_at_get_worker(monkeypatch):
    # The guard that replaces vLLM's platform test: no private fallback (non-writer
    # ranks skip their stores, so private memory would lose their pages).
    import jax_kvoffload.hostmem as hostmem
    from jax_kvoffload.hostmem import _build

    class NoRegion:
        def __init__(self, *args, **kwargs):
            raise hostmem.SharedRegionError("no shared memory here")

    monkeypatch.setattr(_build, "SharedHostRegion", NoRegion)
    cfg = offloading_config(wkb=64, world=2, replicated_layout=True)
    t = torch.zeros((4, 64), dtype=torch.int8)
    kv = base.CanonicalKVCaches(
        [base.CanonicalKVCacheTensor(t, 64)], [[base.CanonicalKVCacheRef(0, 64)]]
    )
    with pytest.raises(hostmem.SharedRegionError, match="no shared memory"):
        bridge.JaxOffloadingSpec(cfg).get_worker(kv)


@pytest.mark.parametrize("budget", [None, 0])
def test_a_missing_budget_is_a_typed_error_naming_the_key(budget):
    extra = {k: v for k, v in EXTRA.items() if k != "cpu_bytes_to_use"}
    if budget is not None:
        extra["cpu_bytes_to_use"] = budget
    with pytest.raises(CapacityError, match="cpu_bytes_to_use"):
        bridge.JaxOffloadingSpec(offloading_config(extra))


def key(i: int, group: int = 0):
    return base.make_offload_key(i.to_bytes(8, "big"), group)


class Twins:
    """Runs every call on our manager and on vLLM's, and checks equal answers."""

    def __init__(self, num_chunks=4, **kw):
        cfg = offloading_config({**EXTRA, "cpu_bytes_to_use": num_chunks * 4096}, wkb=4096)
        self.ours = bridge.JaxOffloadingSpec(cfg).get_manager()
        self.theirs = CPUOffloadingManager(num_chunks=num_chunks, enable_events=True, **kw)
        self.ctx = {m: base.ReqContext("r") for m in ("ours", "theirs")}
        for name in self.ctx:
            getattr(self, name).on_new_request(self.ctx[name])

    def call(self, method, *args):
        answers = []
        for name in ("ours", "theirs"):
            out = getattr(getattr(self, name), method)(*args, self.ctx[name])
            if isinstance(out, base.PrepareStoreOutput):
                out = (out.keys_to_store, out.store_spec.block_ids.tolist(), out.evicted_keys)
            elif isinstance(out, base.LoadStoreSpec):
                out = out.block_ids.tolist()
            answers.append(out)
        assert answers[0] == answers[1], (method, args, answers)
        return answers[0]

    def store(self, ids):
        return self.call("prepare_store", [key(i) for i in ids])

    def complete(self, ids, success=True):
        for name in ("ours", "theirs"):
            getattr(self, name).complete_store([key(i) for i in ids], self.ctx[name], success)

    def lookups(self, ids):
        return [self.call("lookup", key(i)).name for i in ids]

    def events(self):
        out = []
        for m in (self.ours, self.theirs):
            out.append([(e.keys, e.medium, e.removed, e.metadata_only) for e in m.take_events()])
        assert out[0] == out[1]
        assert all(medium is base.Medium.CPU for _, medium, _, _ in out[0])
        return out[0]

    def stats(self):
        out = [m.get_stats().data for m in (self.ours, self.theirs)]
        for name in [n for n in out[0]["data"] if n.startswith(OURS)]:  # our extra metrics
            del out[0]["data"][name], out[0]["types"][name]
        assert out[0] == out[1]
        return out[0]["data"]


def test_g1_full_lru_scenario_answers_like_vllms_manager():
    m = Twins()
    assert m.store([1, 2]) == ([key(1), key(2)], [0, 1], [])
    assert m.lookups([1]) == ["HIT_PENDING"] and m.events() == []
    m.complete([1, 2])
    assert m.events() == [([key(1), key(2)], base.Medium.CPU, False, False)]
    assert m.lookups([1, 2, 3]) == ["HIT", "HIT", "MISS"]
    # 3 free chunks for [3, 4, 5]: the oldest idle key (1) goes, 2 is protected by the offer.
    assert m.store([2, 3, 4, 5]) == ([key(3), key(4), key(5)], [2, 3, 0], [key(1)])
    assert m.store([1, 6]) is None  # everything else is write-pending
    m.complete([2, 3, 4, 5])
    assert m.call("prepare_load", [key(2), key(3)]) == [1, 2]
    assert m.store([6, 7, 8]) is None  # 2 and 3 are pinned by the load
    m.call("complete_load", [key(2), key(3)])
    assert m.store([6, 7, 8]) == ([key(6), key(7), key(8)], [3, 2, 1], [key(2), key(3), key(4)])
    m.complete([6, 7, 8])
    m.call("touch", [key(5), key(6), key(7)])
    assert m.store([9]) == ([key(9)], [1], [key(8)])
    m.complete([7, 9], success=False)
    assert m.lookups([7, 9]) == ["HIT", "MISS"]
    # removed {1}; stored {3,4,5}; removed {2,3,4}; stored {6,7,8}; removed {8}; then the
    # failed store of 9 is a metadata-only removal.
    assert [e[2:] for e in m.events()] == [(True, False), (False, False)] * 2 + [
        (True, False),
        (True, True),
    ]


def test_g3_loads_return_chunks_in_key_order_and_g5_usage_gauges():
    m = Twins()
    m.store([0, 1, 2])
    assert m.stats()["vllm:kv_offload_cpu_cache_write_usage_perc"] == {(): 0.75}
    m.complete([0, 1, 2])
    assert m.call("prepare_load", [key(1), key(2), key(0)]) == [1, 2, 0]
    data = m.stats()
    assert data["vllm:kv_offload_cpu_cache_read_usage_perc"] == {(): 0.75}
    m.ours.reset_cache()
    m.theirs.reset_cache()
    assert m.lookups([0, 1, 2]) == ["MISS"] * 3


def test_a_store_then_load_through_vllms_interfaces_reproduces_the_bytes():
    # Two groups overlaying the same two layer tensors (J2) plus an MLA-like tensor of
    # group 1 with a padded page; 2 blocks per chunk; loads start mid-chunk.
    gen = torch.Generator().manual_seed(0)
    ts = [torch.randint(-128, 128, (12, n), dtype=torch.int8, generator=gen) for n in (64, 64, 48)]
    kv = base.CanonicalKVCaches(
        [base.CanonicalKVCacheTensor(t, t.shape[1]) for t in ts],
        [
            [base.CanonicalKVCacheRef(0, 64), base.CanonicalKVCacheRef(1, 64)],
            [base.CanonicalKVCacheRef(2, 40)],
        ],
    )
    spec = OffloadingSpecFactory.create_spec(offloading_config(wkb=176, bpc=2, groups=2))
    manager, worker = spec.get_manager(), spec.get_worker(kv)
    assert isinstance(worker, base.OffloadingWorker)
    ctx = base.ReqContext("r")
    manager.on_new_request(ctx)
    keys = [key(i, 0) for i in range(2)] + [key(i, 1) for i in range(2)]
    out = manager.prepare_store(keys, ctx)
    src = base.GPULoadStoreSpec([1, 2, 3, 4, 5, 6, 7, 8], [4, 4], [0, 0])
    assert worker.submit_store(7, src, out.store_spec)
    worker.wait({7})
    (result,) = worker.get_finished()
    assert (result.job_id, result.success, result.transfer_size) == (7, True, 4 * 128 + 4 * 40)
    manager.complete_store(out.keys_to_store, ctx)
    before = [t.clone() for t in ts]
    for t in ts:
        t.zero_()
    # Load request blocks 1..3 of group 0 and 1..2 of group 1: both start mid-chunk.
    load_spec = manager.prepare_load(keys, ctx)
    dst = base.GPULoadStoreSpec([9, 10, 11, 0, 6], [3, 2], [1, 1])
    assert worker.submit_load(8, load_spec, dst, expedited=True)
    worker.wait({8})
    (result,) = worker.get_finished()
    assert result.success and result.transfer_size == 3 * 128 + 2 * 40
    manager.complete_load(keys, ctx)
    for t, b in zip(ts[:2], before[:2]):
        assert torch.equal(t[[9, 10, 11]], b[[2, 3, 4]])
    # Only the 40 unpadded bytes of the MLA-like page move (vLLM's byte contract): the
    # padding of the loaded blocks keeps its zeros.
    assert torch.equal(ts[2][[0, 6], :40], before[2][[6, 7], :40])
    assert not ts[2][[0, 6], 40:].any()
    untouched = [i for i in range(12) if i not in (0, 6)]
    assert not ts[2][untouched].any() and not ts[0][:9].any()
    worker.shutdown()
