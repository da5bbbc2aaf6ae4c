"""`JaxOffloadingSpec` with `canonical_layout` inside real vLLM 0.33.0.

vLLM's own `_layer_mapping` certifies each rank's layers; the ranks' workers (several in
this process, sharing one `SharedHostRegion` as vLLM's worker processes would) store their
shards of a reference cache, and the host rows must equal the pages a single device (TP=1)
stores; then each rank loads its shard back, and a TP=4 group loads what TP=2 stored.
Fail-closed refusals are checked on stand-ins (no vLLM needed).
"""

from __future__ import annotations

import itertools
import os
from types import SimpleNamespace

import numpy as np
import pytest

from jax_kvoffload.bridge._vllm_pools import CanonicalWorkerError, tensor_mappings
from jax_kvoffload.config import CanonicalLayoutError, FullAttentionSpec, OffloadingConfig
from jax_kvoffload.config.canonical import KVTensorView, RankContext, layer_mapping

_ids = itertools.count()


def our_config(world=2, agnostic=False):
    return OffloadingConfig.from_dict(
        {
            "groups": [{"tokens_per_block": 4, "layer_names": ["l0"], "group_id": 0}],
            "worker_kv_bytes_per_block": 64,
            "enable_kv_cache_events": False,
            "extra_config": {"canonical_layout": True},
            "engine_id": "e",
            "model": {"name": "m", "dtype": "bfloat16"},
            "cache": {"tokens_per_hash": 4, "blocks_per_chunk": 1},
            "parallel": {
                "rank": 0,
                "world_size": world,
                "tp_size": world,
                "pp_size": 1,
                "pcp_size": 1,
                "dcp_size": 1,
                "data_parallel_index": 0,
                "data_parallel_size": 1,
                "data_parallel_rank_local": None,
                "is_parallelism_agnostic": agnostic,
            },
            "canonical_layout": True,
        }
    )


def stand_in_caches(mappings_per_ref):
    refs = [
        SimpleNamespace(tensor_idx=t, page_size_bytes=64, mapping=m) for t, m in mappings_per_ref
    ]
    return SimpleNamespace(tensors=[], group_data_refs=[refs])


def a_mapping(tp=2, rank=0, heads=2):
    spec = FullAttentionSpec(block_size=4, num_kv_heads=heads // tp, head_size=4, dtype="bfloat16")
    view = KVTensorView.split(3, heads // tp, 4, 4, 2, "nhd")
    return layer_mapping(spec, view, 3, RankContext(tp, 1, 1, 1, heads, rank))


def test_an_uncertified_layer_fails_closed_naming_it_and_the_way_out():
    caches = stand_in_caches([(0, a_mapping()), (1, None)])
    with pytest.raises(
        CanonicalWorkerError, match=r"group 0 layer 1 .*Remove 'canonical_layout'"
    ) as e:
        tensor_mappings(caches, our_config())
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, CanonicalLayoutError)
    assert isinstance(e.value, ValueError) and e.value.reason == "uncertified"


def test_a_portability_claim_the_layers_do_not_keep_is_refused():
    import dataclasses

    m = dataclasses.replace(a_mapping(), parallelism_agnostic=False)
    with pytest.raises(CanonicalWorkerError, match="is_parallelism_agnostic"):
        tensor_mappings(stand_in_caches([(0, m)]), our_config(agnostic=True))
    assert tensor_mappings(stand_in_caches([(0, m)]), our_config())[1] is False


def test_two_mappings_on_one_tensor_are_refused():
    caches = stand_in_caches([(0, a_mapping(rank=0)), (0, a_mapping(tp=1, heads=1))])
    with pytest.raises(CanonicalWorkerError, match="one mapping per tensor"):
        tensor_mappings(caches, our_config())


# -- real vLLM ---------------------------------------------------------------------------

vllm_only = pytest.mark.vllm


def _vllm():
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed")
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import canonical_mapping as cm
    from vllm.v1 import kv_cache_interface as kvi
    from vllm.v1.kv_offload import base
    from vllm.v1.kv_offload import config as vc
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from jax_kvoffload.bridge import vllm as bridge

    return SimpleNamespace(
        torch=torch, cm=cm, kvi=kvi, base=base, vc=vc, CPU=CPULoadStoreSpec, bridge=bridge
    )


NB, BS, HS, LAYERS = 10, 4, 8, 2


def full_caches(v, form, heads, seed=0):
    """One TP=1 cache per layer in vLLM's physical layout (block dim first), bf16 bits."""
    gen = v.torch.Generator().manual_seed(seed)
    shape = {
        "split-nhd": (NB, 2, BS, heads, HS),
        "split-hnd": (NB, 2, heads, BS, HS),
        "mla": (NB, BS, HS),
    }[form]
    return [
        v.torch.randint(-(2**15), 2**15, shape, dtype=v.torch.int16, generator=gen).view(
            v.torch.bfloat16
        )
        for _ in range(LAYERS)
    ]


def shard(form, full, tp, rank, heads):
    if form == "mla":
        return full.clone()
    h = max(1, heads // tp)
    first = rank * heads // tp  # GQA (heads < tp): neighbouring ranks share a head
    axis = 3 if form == "split-nhd" else 2
    return full.narrow(axis, first, h).contiguous()


def rank_kv(v, form, tp, rank, heads, caches, pad=0, wrap=lambda t: t):
    """One rank's `CanonicalKVCaches` over `caches`, certified by vLLM's `_layer_mapping`;
    with `pad`, each cache is the leading bytes of a `page + pad`-byte row (vLLM's padded
    pages: the tensor's page is padded, the ref's page is not)."""
    if form == "mla":
        spec = v.kvi.MLAAttentionSpec(
            block_size=BS, num_kv_heads=1, head_size=HS, dtype=v.torch.bfloat16
        )
    else:
        spec = v.kvi.FullAttentionSpec(
            block_size=BS, num_kv_heads=max(1, heads // tp), head_size=HS, dtype=v.torch.bfloat16
        )
    ctx = v.cm._RankContext(tp, 1, 1, 1, heads, rank)
    tensors, refs = [], []
    for i, c in enumerate(caches):
        # vLLM reads the layout from a logical NHD view's strides (HND: permuted).
        logical = c.permute(0, 1, 3, 2, 4) if form == "split-hnd" else c
        mapping = v.cm._layer_mapping(spec, logical, NB, ctx)
        assert mapping is not None
        flat = c.view(v.torch.int8).view(NB, -1)
        row = flat.shape[1] + pad
        whole = flat.as_strided((NB, row), (row, 1))
        tensors.append(v.base.CanonicalKVCacheTensor(wrap(whole), row))
        refs.append(v.base.CanonicalKVCacheRef(i, flat.shape[1], mapping))
    return v.base.CanonicalKVCaches(tensors, [refs])


def rank_worker(v, form, tp, rank, heads, caches, engine_id, canonical=True, pad=0):
    """One rank's spec and worker over `caches` (see `rank_kv`)."""
    kv = rank_kv(v, form, tp, rank, heads, caches, pad)
    tensors = kv.tensors
    agnostic = form != "mla"
    cfg = v.vc.OffloadingConfig(
        groups=(v.vc.OffloadingGroupConfig(BS, tuple(f"l{i}" for i in range(LAYERS)), 0),),
        worker_kv_bytes_per_block=sum(t.page_size_bytes for t in tensors),
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "JaxOffloadingSpec",
            "spec_module_path": "jax_kvoffload.bridge.vllm",
            "cpu_bytes_to_use": 1 << 20,
            **({"canonical_layout": True} if canonical else {}),
        },
        engine_id=engine_id,
        model=v.vc.OffloadingModelConfig("m", "bfloat16", 100),
        cache=v.vc.OffloadingCacheConfig(BS, 2),
        parallel=v.vc.OffloadingParallelConfig(rank, tp, tp, 1, 1, 1, 0, 1, None, agnostic),
        canonical_layout=canonical,
        replicated_layout=form == "mla",
    )
    spec_obj = v.bridge.JaxOffloadingSpec(cfg)
    return spec_obj, spec_obj.get_worker(kv)


def run(worker, job, direction, blocks, chunks, v):
    gpu = v.base.GPULoadStoreSpec(blocks, [len(blocks)], [0])
    cpu = v.CPU(np.asarray(chunks, dtype=np.int64))
    if direction == "store":
        assert worker.submit_store(job, gpu, cpu)
    else:
        assert worker.submit_load(job, cpu, gpu)
    worker.wait({job})
    (r,) = worker.get_finished()
    assert r.success, r
    return r


def group(v, form, tp, heads, full, engine_id):
    out = []
    for r in range(tp):
        caches = [shard(form, f, tp, r, heads) for f in full]
        spec, worker = rank_worker(v, form, tp, r, heads, caches, engine_id)
        out.append((caches, spec, worker))
    return out


def host_rows(worker):
    pool = worker.pool.pool
    return [pool.rows(t).copy() for t in sorted(pool.bytes_per_block)]


BLOCKS, CHUNKS = [7, 2, 5, 0], [3, 1]  # 2 blocks per chunk


def reload_own_shard(v, worker, caches, job):
    """Zeroes the rank's caches, loads BLOCKS back from the host, checks the bytes."""
    before = [c.clone() for c in caches]
    for c in caches:
        c.view(v.torch.int16).zero_()
    run(worker, job, "load", BLOCKS, CHUNKS, v)
    for c, b in zip(caches, before, strict=True):
        assert v.torch.equal(c[BLOCKS].view(v.torch.int16), b[BLOCKS].view(v.torch.int16))


@vllm_only
@pytest.mark.parametrize(
    ("form", "heads", "tp", "tp_load"),
    [
        ("split-nhd", 4, 2, 4),
        ("split-hnd", 4, 2, 1),
        ("split-nhd", 2, 4, 2),  # GQA: 2 KV heads over 4 ranks, writers rotate
        ("mla", 1, 2, 4),  # replicated latent: one host copy
    ],
)
def test_ranks_store_tp1_pages_and_another_tp_loads_them(form, heads, tp, tp_load):
    v = _vllm()
    full = full_caches(v, form, heads)
    # TP=1 reference: the canonical pages are the single device's pages.
    ((_, _, ref_worker),) = group(v, form, 1, heads, full, f"ref{next(_ids)}")
    ref_size = run(ref_worker, 1, "store", BLOCKS, CHUNKS, v).transfer_size
    reference = host_rows(ref_worker)
    # TP=tp group: every rank stores its shard into the shared rows.
    ranks = group(v, form, tp, heads, full, f"tp{next(_ids)}")
    written = 0
    for _, spec, worker in ranks:
        # MLA's replicated latent is one host copy: sized like vLLM's shared region.
        assert spec.replicated_layout == (form == "mla")
        written += run(worker, 2, "store", BLOCKS, CHUNKS, v).transfer_size
    # Sizes count the bytes each rank wrote (vLLM's rule): every canonical byte once.
    assert written == ref_size == len(BLOCKS) * sum(r.shape[1] for r in reference) // 2
    for got, want in zip(host_rows(ranks[0][2]), reference, strict=True):
        np.testing.assert_array_equal(got, want)
    # Each rank loads its shard back into zeroed caches.
    for caches, _, worker in ranks:
        reload_own_shard(v, worker, caches, job=3)
    # A TP=tp_load group loads the same host bytes (as a secondary tier would hand them).
    others = group(v, form, tp_load, heads, [f.clone().zero_() for f in full], f"x{next(_ids)}")
    pool = others[0][2].pool.pool
    for t, rows in enumerate(reference):
        pool.rows(t)[...] = rows
    for r, (caches, _, worker) in enumerate(others):
        run(worker, 4, "load", BLOCKS, CHUNKS, v)
        for c, f in zip(caches, full, strict=True):
            want = shard(form, f, tp_load, r, heads)[BLOCKS]
            assert v.torch.equal(c[BLOCKS].view(v.torch.int16), want.view(v.torch.int16))
    for _, _, worker in [*ranks, *others, (None, None, ref_worker)]:
        worker.shutdown()


def padded(v, cache, pad, gen):
    """`cache` copied into the leading bytes of noise-filled `page + pad`-byte rows."""
    page = cache[0].numel() * cache.element_size()
    rows = v.torch.randint(-128, 128, (NB, page + pad), dtype=v.torch.int8, generator=gen)
    rows[:, :page] = cache.view(v.torch.int8).reshape(NB, page)
    return rows, rows[:, :page].view(cache.dtype).view(cache.shape)


@vllm_only
@pytest.mark.parametrize("form", ["split-nhd", "mla"])
def test_canonical_pages_of_padded_tensors_move_only_the_mapped_bytes(form):
    # vLLM's canonical copy plans cover the unpadded page: a load must leave every
    # padding byte (and every block it does not load) exactly as it was.
    v = _vllm()
    gen = v.torch.Generator().manual_seed(5)
    heads, tp, pad = (4, 2, 24) if form != "mla" else (1, 1, 40)
    full = full_caches(v, form, heads, seed=5)
    engine = f"pad{next(_ids)}"
    ranks = []
    for r in range(tp):
        rows, caches = zip(*(padded(v, shard(form, f, tp, r, heads), pad, gen) for f in full))
        _, worker = rank_worker(v, form, tp, r, heads, list(caches), engine, pad=pad)
        # Host slots hold the unpadded page's canonical bytes, never the padding.
        assert worker.widths == {t: c[0].numel() * 2 for t, c in enumerate(caches)}
        ranks.append((list(rows), worker))
    for _, worker in ranks:
        assert run(worker, 1, "store", BLOCKS, CHUNKS, v).success
    for r, (rows, worker) in enumerate(ranks):
        for row in rows:
            row.copy_(v.torch.randint(-128, 128, row.shape, dtype=v.torch.int8, generator=gen))
        before = [row.clone() for row in rows]
        run(worker, 2, "load", BLOCKS, CHUNKS, v)
        for row, old, f in zip(rows, before, full, strict=True):
            page = row.shape[1] - pad
            want = shard(form, f, tp, r, heads).view(v.torch.int8).reshape(NB, page)
            assert v.torch.equal(row[BLOCKS, :page], want[BLOCKS])
            assert v.torch.equal(row[:, page:], old[:, page:])  # padding untouched
            others = [b for b in range(NB) if b not in BLOCKS]
            assert v.torch.equal(row[others], old[others])
    for _, worker in ranks:
        worker.shutdown()


@vllm_only
def test_an_uncertified_vllm_layout_fails_closed_at_get_worker():
    v = _vllm()
    full = full_caches(v, "split-nhd", 4)
    caches = [shard("split-nhd", f, 2, 0, 4) for f in full]
    spec, worker = rank_worker(v, "split-nhd", 2, 0, 4, caches, f"bad{next(_ids)}")
    worker.shutdown()
    tensors = [
        v.base.CanonicalKVCacheTensor(c.view(v.torch.int8).view(NB, -1), 2 * BS * 2 * HS * 2)
        for c in caches
    ]
    refs = [v.base.CanonicalKVCacheRef(i, t.page_size_bytes, None) for i, t in enumerate(tensors)]
    spec._worker = None
    with pytest.raises(RuntimeError, match="could not be certified"):
        spec.get_worker(v.base.CanonicalKVCaches(tensors, [refs]))


@vllm_only
def test_replicated_mla_pages_are_one_copy_written_by_rank_0_and_read_by_all():
    # Without canonical pages: vLLM's connector lets only rank 0 store (it reads the
    # spec's replicated_layout); every rank loads from the one region they all map.
    v = _vllm()
    full = full_caches(v, "mla", 1, seed=3)
    engine = f"rep{next(_ids)}"
    caches = [[f.clone() for f in full] for _ in range(2)]
    ranks = [rank_worker(v, "mla", 2, r, 1, caches[r], engine, canonical=False) for r in range(2)]
    (spec0, w0), (spec1, w1) = ranks
    assert spec0.replicated_layout and spec1.replicated_layout
    run(w0, 1, "store", BLOCKS, CHUNKS, v)  # rank 0 only, as vLLM gates it
    # Two mappings of one memory: rank 1 sees rank 0's rows without any copy.
    for t in range(LAYERS):
        assert w1.pool.rows(t).any()
        np.testing.assert_array_equal(w1.pool.rows(t), w0.pool.rows(t))
    for c in caches[1]:
        c.view(v.torch.int16).zero_()
    run(w1, 2, "load", BLOCKS, CHUNKS, v)
    for c, f in zip(caches[1], full, strict=True):
        assert v.torch.equal(c[BLOCKS].view(v.torch.int16), f[BLOCKS].view(v.torch.int16))
    for _, w in ranks:
        w.shutdown()


@vllm_only
def test_replicated_pages_fail_until_every_rank_has_mapped_the_region(caplog):
    # Only rank 0 stores replicated pages; a rank whose peers never map the region (on
    # another host) would load pages nobody wrote: its jobs fail until all have joined.
    v = _vllm()
    full = full_caches(v, "mla", 1, seed=4)
    engine = f"repalone{next(_ids)}"
    _, w0 = rank_worker(v, "mla", 2, 0, 1, [f.clone() for f in full], engine, canonical=False)
    gpu = v.base.GPULoadStoreSpec(BLOCKS, [len(BLOCKS)], [0])
    assert w0.submit_store(1, gpu, v.CPU(np.asarray(CHUNKS, dtype=np.int64)))
    (r,) = w0.get_finished()
    assert (r.job_id, r.success) == (1, False)
    assert "only 1 of the 2 worker processes" in caplog.text
    _, w1 = rank_worker(v, "mla", 2, 1, 1, [f.clone() for f in full], engine, canonical=False)
    assert run(w0, 2, "store", BLOCKS, CHUNKS, v).success
    w0.shutdown()
    w1.shutdown()


def _rank_process(form, tp, rank, heads, engine_id, barrier, rows_out):
    """One vLLM worker process: maps the region, stores its shard once every rank has,
    waits for the others, hands rank 0's view of the rows to the parent, then loads."""
    v = _vllm()
    full = full_caches(v, form, heads)
    caches = [shard(form, f, tp, rank, heads) for f in full]
    _, worker = rank_worker(v, form, tp, rank, heads, caches, engine_id)
    barrier.wait(120)  # vLLM serves only once every worker has registered its caches
    run(worker, 1, "store", BLOCKS, CHUNKS, v)
    barrier.wait(120)
    if rank == 0:
        rows_out.put([r.tobytes() for r in host_rows(worker)])
    reload_own_shard(v, worker, caches, job=2)
    barrier.wait(120)  # nobody unmaps before every rank has loaded
    worker.shutdown()


@vllm_only
@pytest.mark.slow  # worker processes on a shared region: ~16 s on 2 idle cores
def test_worker_processes_share_one_region_of_canonical_pages():
    # As under vLLM's multiprocess executor: one process per rank, one /dev/shm region.
    import multiprocessing as mp

    v = _vllm()
    form, tp, heads = "split-nhd", 2, 4
    ((_, _, ref_worker),) = group(v, form, 1, heads, full_caches(v, form, heads), "mpref")
    run(ref_worker, 1, "store", BLOCKS, CHUNKS, v)
    reference = host_rows(ref_worker)
    ref_worker.shutdown()
    ctx = mp.get_context("spawn")
    barrier, rows = ctx.Barrier(tp), ctx.Queue()
    engine = f"mp{os.getpid()}"
    procs = [
        ctx.Process(target=_rank_process, args=(form, tp, r, heads, engine, barrier, rows))
        for r in range(tp)
    ]
    for p in procs:
        p.start()
    got = rows.get(timeout=300)
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0] * tp
    for g, want in zip(got, reference, strict=True):
        np.testing.assert_array_equal(np.frombuffer(g, np.uint8).reshape(want.shape), want)


@vllm_only
def test_jobs_fail_until_every_rank_has_mapped_the_region(caplog):
    # A rank alone (its peers on another host, or not started): storing would leave
    # rotated blocks nobody writes, so jobs end as failures until the group is complete.
    v = _vllm()
    form, tp, heads = "split-nhd", 2, 2  # GQA: writers rotate
    full = full_caches(v, form, heads)
    engine = f"alone{next(_ids)}"
    caches0 = [shard(form, f, tp, 0, heads) for f in full]
    _, w0 = rank_worker(v, form, tp, 0, heads, caches0, engine)
    gpu = v.base.GPULoadStoreSpec(BLOCKS, [len(BLOCKS)], [0])
    assert w0.submit_store(1, gpu, v.CPU(np.asarray(CHUNKS, dtype=np.int64)))
    (r,) = w0.get_finished()
    assert (r.job_id, r.success) == (1, False)
    assert "only 1 of the 2 worker processes" in caplog.text
    caches1 = [shard(form, f, tp, 1, heads) for f in full]
    _, w1 = rank_worker(v, form, tp, 1, heads, caches1, engine)
    assert run(w0, 2, "store", BLOCKS, CHUNKS, v).success
    w0.shutdown()
    w1.shutdown()
