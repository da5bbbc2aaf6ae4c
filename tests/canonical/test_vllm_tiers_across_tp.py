"""`JaxOffloadingSpec` with `canonical_layout` and `secondary_tiers`, in real vLLM 0.33.0.

An engine at TP=2 (a scheduler-side spec whose manager is vLLM's tiering manager, and
one worker per rank over its shard of a reference cache, certified by vLLM's own
`_layer_mapping`) stores a prefix; the cascade writes each chunk's canonical pages into
the tier. Fresh engines at TP=1 and TP=4 (other engine ids: other, empty host rows) find
the prefix in the tier, vLLM promotes it, and every rank loads its own heads bit for
bit (through the disk tier, a Redis server and a 3-primary Redis Cluster). A direct
(per-rank) engine of the same model misses those entries, and a canonical
engine misses a direct engine's.
"""

from __future__ import annotations

import itertools
import time
import uuid

import numpy as np
import pytest

from tests.bridge.test_vllm_canonical import BS, LAYERS, _vllm, full_caches, rank_kv, shard
from tests.tiers._helpers import NO_REDIS, REDIS_SERVER, RedisServer

pytestmark = pytest.mark.vllm

BPC, CHUNKS = 2, 3
BLOCKS = [7, 2, 5, 0, 9, 4]  # 3 chunks of 2 blocks
LAYOUT = {"split-nhd": "LBNHC", "split-hnd": "LBHNC"}


class Engine:
    """One engine of `tp` ranks: the scheduler's manager and a worker per rank."""

    def __init__(self, v, form, tp, heads, full, tiers, canonical=True, bpc=BPC, blocks=BLOCKS):
        self.v, self.tp, self.bpc, self.blocks = v, tp, bpc, blocks
        engine_id = f"jkv-canon-tiers-{uuid.uuid4().hex[:10]}"
        self.caches = [[shard(form, f, tp, r, heads) for f in full] for r in range(tp)]
        kvs = [rank_kv(v, form, tp, r, heads, self.caches[r]) for r in range(tp)]
        if not canonical:  # the same tensors, no mappings: direct pages
            kvs = [
                v.base.CanonicalKVCaches(
                    kv.tensors,
                    [[v.base.CanonicalKVCacheRef(r.tensor_idx, r.page_size_bytes) for r in g]
                     for g in kv.group_data_refs],
                )
                for kv in kvs
            ]  # fmt: skip
        specs = [self._spec(form, tp, r, kvs[r], engine_id, tiers, canonical) for r in range(tp)]
        self.manager = specs[0].get_manager()  # the scheduler's (rank 0's config)
        self.workers = [s.get_worker(kv) for s, kv in zip(specs, kvs, strict=True)]
        self.jobs = itertools.count(1)

    def _spec(self, form, tp, rank, kv, engine_id, tiers, canonical):
        v = self.v
        cfg = v.vc.OffloadingConfig(
            groups=(v.vc.OffloadingGroupConfig(BS, tuple(f"l{i}" for i in range(LAYERS)), 0),),
            worker_kv_bytes_per_block=sum(t.page_size_bytes for t in kv.tensors),
            enable_kv_cache_events=False,
            extra_config={
                "spec_name": "JaxOffloadingSpec",
                "spec_module_path": "jax_kvoffload.bridge.vllm",
                "cpu_bytes_to_use": 1 << 20,
                "secondary_tiers": tiers,
                **({"canonical_layout": True} if canonical else {}),
            },
            engine_id=engine_id,
            model=v.vc.OffloadingModelConfig("m", "bfloat16", 100),
            cache=v.vc.OffloadingCacheConfig(BS, self.bpc),
            parallel=v.vc.OffloadingParallelConfig(rank, tp, tp, 1, 1, 1, 0, 1, None, True),
            canonical_layout=canonical,
            kv_cache_layout=LAYOUT[form],
        )
        return v.bridge.JaxOffloadingSpec(cfg)

    def step(self):
        with self.manager.lock:
            self.manager.on_schedule_end(self.v.base.ScheduleEndContext((), ()))

    def transfer(self, direction, chunk_spec):
        gpu = self.v.base.GPULoadStoreSpec(self.blocks, [len(self.blocks)], [0])
        job = next(self.jobs)
        for w in self.workers:
            if direction == "store":
                assert w.submit_store(job, gpu, chunk_spec)
            else:
                assert w.submit_load(job, chunk_spec, gpu)
        for w in self.workers:
            w.wait({job})
            (r,) = w.get_finished()
            assert r.success, r

    def store(self, keys):
        ctx = self.v.base.ReqContext("store")
        with self.manager.lock:
            self.manager.on_new_request(ctx)
            out = self.manager.prepare_store(keys, ctx)
        self.transfer("store", out.store_spec)
        chunks = [int(c) for c in out.store_spec.block_ids]
        with self.manager.lock:
            self.manager.complete_store(out.keys_to_store, ctx)  # cascades to the tier
            self.manager.on_request_finished(ctx)
        deadline = time.monotonic() + 30
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "the cascade did not finish"
            self.step()
            time.sleep(0.005)
        return chunks

    def rows(self, chunks):
        """The scheduler's host rows of `chunks` (what the tiers store), as bytes."""
        view = np.asarray(self.manager.primary_tier.get_kv_memoryview())
        return [view[c].tobytes() for c in chunks]

    def lookup(self, keys, timeout=10.0):
        """vLLM's answers once they stop changing (RETRY / HIT_PENDING while the tier
        looks and promotes); the names seen on the way."""
        ctx = self.v.base.ReqContext("load")
        seen = set()
        deadline = time.monotonic() + timeout
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        while True:
            with self.manager.lock:
                answers = [self.manager.lookup(k, ctx) for k in keys]
            seen.update(a.name for a in answers)
            done = all(a.name in ("HIT", "MISS") for a in answers)
            if done or time.monotonic() > deadline:
                return answers, seen, ctx
            self.step()
            time.sleep(0.005)

    def load(self, keys, ctx):
        with self.manager.lock:
            spec = self.manager.prepare_load(keys, ctx)
        self.transfer("load", spec)
        with self.manager.lock:
            self.manager.complete_load(keys, ctx)
            self.manager.on_request_finished(ctx)

    def close(self):
        for w in self.workers:
            w.shutdown()
        self.manager.shutdown()


def page_bytes(v, pages):
    return pages.contiguous().view(v.torch.int16).numpy().tobytes()


def keys(v, n, seed):
    return [v.base.make_offload_key(f"{seed}:{i}".encode().ljust(32, b"."), 0) for i in range(n)]


@pytest.fixture(params=["disk", "redis", "cluster"])
def tier(request, tmp_path):
    if request.param == "disk":
        yield {"type": "disk", "path": str(tmp_path / "tier"), "capacity_bytes": "64MiB"}
        return
    if request.param == "cluster":  # the session's 3-primary cluster, a prefix of our own
        cluster = request.getfixturevalue("redis_cluster")
        prefix = f"vllm-tp-{uuid.uuid4().hex[:8]}:jkv"
        yield {"type": "redis", "url": cluster.url, "cluster": "on", "key_prefix": prefix}
        return
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS)
    server = RedisServer()
    try:
        yield {"type": "redis", "url": server.url}
    finally:
        server.stop()


@pytest.mark.parametrize(("form", "heads"), [("split-nhd", 4), ("split-hnd", 4)])
def test_a_tp2_prefix_cascades_and_loads_at_tp1_and_tp4(tier, form, heads):
    v = _vllm()
    full = full_caches(v, form, heads, seed=1)
    ks = keys(v, CHUNKS, seed=form)
    writer = Engine(v, form, 2, heads, full, [tier])
    try:
        chunks = writer.store(ks)
        # Each row is vLLM's canonical row: per tensor, the TP=1 pages of the chunk's
        # blocks (`SharedOffloadRegion.create_next_canonical_view`), every rank's bytes,
        # then zeros up to the row's size (vLLM aligns rows to 4 KiB).
        for i, row in enumerate(writer.rows(chunks)):
            blocks = BLOCKS[i * BPC : (i + 1) * BPC]
            want = b"".join(page_bytes(v, f[blocks]) for f in full)
            assert row[: len(want)] == want, i
            assert not any(row[len(want) :]), i
    finally:
        writer.close()
    for tp in (1, 4):
        zeros = [f.clone().zero_() for f in full]
        reader = Engine(v, form, tp, heads, zeros, [tier])
        try:
            answers, seen, ctx = reader.lookup(ks)
            assert [a.name for a in answers] == ["HIT"] * CHUNKS, (tp, answers)
            assert seen & {"RETRY", "HIT_PENDING"}, seen  # it came from the tier
            reader.load(ks, ctx)
            for r, caches in enumerate(reader.caches):
                for got, f in zip(caches, full, strict=True):
                    want = shard(form, f, tp, r, heads)[BLOCKS]
                    assert v.torch.equal(
                        got[BLOCKS].view(v.torch.int16), want.view(v.torch.int16)
                    ), (tp, r)
        finally:
            reader.close()


def test_canonical_and_direct_engines_never_read_each_others_entries(tmp_path):
    v = _vllm()
    form, heads = "split-nhd", 4
    full = full_caches(v, form, heads, seed=2)
    tier = {"type": "disk", "path": str(tmp_path / "tier"), "capacity_bytes": "64MiB"}
    for writer_canonical in (True, False):
        ks = keys(v, CHUNKS, seed=f"w{writer_canonical}")
        writer = Engine(v, form, 2, heads, full, [tier], canonical=writer_canonical)
        try:
            writer.store(ks)
        finally:
            writer.close()
        zeros = [f.clone().zero_() for f in full]
        other = Engine(v, form, 2, heads, zeros, [tier], canonical=not writer_canonical)
        try:
            answers, _, _ = other.lookup(ks, timeout=3.0)
            assert [a.name for a in answers] == ["MISS"] * CHUNKS, (writer_canonical, answers)
        finally:
            other.close()
        same = Engine(v, form, 2, heads, zeros, [tier], canonical=writer_canonical)
        try:  # the positive control: the entries are there
            answers, _, _ = same.lookup(ks)
            assert [a.name for a in answers] == ["HIT"] * CHUNKS, (writer_canonical, answers)
        finally:
            same.close()


def test_with_fewer_kv_heads_than_ranks_a_larger_tp_misses_and_never_reads_wrong_bytes(tmp_path):
    # Rows are sized as vLLM sizes them (world size x one rank's page, rounded up to
    # 4 KiB): at TP=4 with 2 KV heads a row holds 4 ranks' single heads, twice the
    # canonical pages, so its entries and TP=2's differ in length (here 8 KiB against
    # 4 KiB: one chunk of 8 blocks). The tier checks the length: TP=4 misses (and
    # recomputes), TP=1 hits.
    v = _vllm()
    form, heads, bpc, blocks = "split-nhd", 2, 8, [7, 2, 5, 0, 9, 4, 1, 3]
    full = full_caches(v, form, heads, seed=3)
    tier = {"type": "disk", "path": str(tmp_path / "tier"), "capacity_bytes": "64MiB"}
    ks = keys(v, 1, seed="gqa")
    writer = Engine(v, form, 2, heads, full, [tier], bpc=bpc, blocks=blocks)
    try:
        writer.store(ks)
    finally:
        writer.close()
    for tp, expect in ((4, "MISS"), (1, "HIT")):
        zeros = [f.clone().zero_() for f in full]
        reader = Engine(v, form, tp, heads, zeros, [tier], bpc=bpc, blocks=blocks)
        try:
            answers, _, ctx = reader.lookup(ks)
            assert [a.name for a in answers] == [expect], (tp, answers)
            if expect == "MISS":
                continue
            reader.load(ks, ctx)
            for r, caches in enumerate(reader.caches):
                for got, f in zip(caches, full, strict=True):
                    want = shard(form, f, tp, r, heads)[blocks]
                    assert v.torch.equal(got[blocks].view(v.torch.int16), want.view(v.torch.int16))
        finally:
            reader.close()


def test_direct_rows_of_another_tp_size_are_misses_not_wrong_bytes(tmp_path):
    # A row of direct pages holds each rank's slice of every layer in the rank's own
    # area: at TP=4 the same KV sits in other bytes of a row of the same length, so the
    # topology stays in the namespace of direct rows (vLLM's agnostic claim
    # notwithstanding). Before: the TP=4 engine hit and loaded wrong bytes (valid CRCs).
    v = _vllm()
    form, heads = "split-nhd", 4
    full = full_caches(v, form, heads, seed=4)
    tier = {"type": "disk", "path": str(tmp_path / "tier"), "capacity_bytes": "64MiB"}
    ks = keys(v, CHUNKS, seed="direct")
    writer = Engine(v, form, 2, heads, full, [tier], canonical=False)
    try:
        writer.store(ks)
    finally:
        writer.close()
    for tp, expect in ((4, "MISS"), (2, "HIT")):
        zeros = [f.clone().zero_() for f in full]
        reader = Engine(v, form, tp, heads, zeros, [tier], canonical=False)
        try:
            answers, _, ctx = reader.lookup(ks, timeout=10.0 if expect == "HIT" else 3.0)
            assert [a.name for a in answers] == [expect] * CHUNKS, (tp, answers)
            if expect == "MISS":
                continue
            reader.load(ks, ctx)  # the same TP size: the rows are its own
            for r, caches in enumerate(reader.caches):
                for got, f in zip(caches, full, strict=True):
                    want = shard(form, f, tp, r, heads)[BLOCKS]
                    assert v.torch.equal(got[BLOCKS].view(v.torch.int16), want.view(v.torch.int16))
        finally:
            reader.close()
