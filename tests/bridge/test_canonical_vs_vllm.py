"""Canonical pages side by side with vLLM 0.33.0's own canonical `CPUOffloadingWorker`.

vLLM's worker runs on CPU as in `test_worker_vs_vllm.py` (`worker_twins.vllm_on_cpu`), its
ranks sharing one canonical host view per tensor as they would share vLLM's mmap region.
Every rank of a TP group stores the same blocks on both sides; each rank's
`transfer_size` (writer rotation applied), the canonical host rows and, after loads into
noise-filled caches, every device byte (padding included) must be identical.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

pytest.importorskip("torch")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed")

from tests.bridge.test_vllm_canonical import (
    BLOCKS,
    CHUNKS,
    _vllm,
    full_caches,
    padded,
    rank_kv,
    rank_worker,
    run,
    shard,
)

pytestmark = pytest.mark.vllm

_ids = itertools.count()


class SharedCanonicalViews:
    """vLLM's `SharedOffloadRegion` as the canonical handler uses it: every rank carves
    the same per-tensor views, in tensor order, from one shared memory."""

    def __init__(self, torch, num_chunks):
        self.torch, self.num_chunks, self.views = torch, num_chunks, []

    def for_rank(self):
        region, cursor = self, itertools.count()

        class View:
            def create_next_canonical_view(self, size):
                i = next(cursor)
                if i == len(region.views):
                    region.views.append(
                        region.torch.zeros((region.num_chunks, size)).to(region.torch.int8)
                    )
                assert region.views[i].shape[1] == size
                return region.views[i]

            def cleanup(self):
                pass

        return View()


@pytest.fixture
def vllm_cls(monkeypatch):
    from tests.bridge.worker_twins import vllm_on_cpu

    with vllm_on_cpu(monkeypatch) as cls:
        yield cls


@pytest.mark.parametrize(
    ("form", "heads", "tp", "pad"),
    [
        ("split-nhd", 4, 2, 0),
        ("split-hnd", 4, 2, 24),
        ("split-nhd", 2, 4, 8),  # GQA: 2 KV heads over 4 ranks, writers rotate
        ("mla", 1, 2, 40),  # replicated latent, padded page
    ],
)
def test_canonical_pages_match_vllms_canonical_worker(form, heads, tp, pad, vllm_cls):
    from tests.bridge.worker_twins import FakeCuda

    v = _vllm()
    gen = v.torch.Generator().manual_seed(7)
    full = full_caches(v, form, heads, seed=7)
    engine = f"cvv{next(_ids)}"
    ours, theirs, region = [], [], None
    for r in range(tp):
        rows, caches = zip(*(padded(v, shard(form, f, tp, r, heads), pad, gen) for f in full))
        twin = [row.clone() for row in rows]
        twin_caches = [
            t[:, : t.shape[1] - pad].view(c.dtype).view(c.shape)
            for t, c in zip(twin, caches, strict=True)
        ]
        spec, worker = rank_worker(v, form, tp, r, heads, list(caches), engine, pad=pad)
        if region is None:
            region = SharedCanonicalViews(v.torch, spec.num_chunks)
        kv = rank_kv(
            v, form, tp, r, heads, twin_caches, pad, lambda t: FakeCuda._make_subclass(FakeCuda, t)
        )
        vllm_worker = vllm_cls(
            kv,
            blocks_per_chunk=2,
            num_cpu_chunks=spec.num_chunks,
            mmap_region=region.for_rank(),
            canonical_layout=True,
        )
        ours.append((list(rows), worker))
        theirs.append((twin, vllm_worker))
    for (_, mine), (_, other) in zip(ours, theirs, strict=True):
        assert run(mine, 1, "store", BLOCKS, CHUNKS, v).transfer_size == (
            run(other, 1, "store", BLOCKS, CHUNKS, v).transfer_size
        )
    pool = ours[0][1].pool.pool
    for t, view in enumerate(region.views):
        np.testing.assert_array_equal(pool.rows(t), view.numpy().view(np.uint8))
    for (rows, mine), (twin, other) in zip(ours, theirs, strict=True):
        noises = []
        for a, b in zip(rows, twin, strict=True):
            noises.append(v.torch.randint(-128, 128, a.shape, dtype=v.torch.int8, generator=gen))
            a.copy_(noises[-1])
            b.copy_(noises[-1])
        assert run(mine, 2, "load", BLOCKS, CHUNKS, v).transfer_size == (
            run(other, 2, "load", BLOCKS, CHUNKS, v).transfer_size
        )
        for a, b, before in zip(rows, twin, noises, strict=True):
            assert v.torch.equal(a, b)
            assert not v.torch.equal(a[BLOCKS], before[BLOCKS])  # the load did write
    for (_, mine), (_, other) in zip(ours, theirs, strict=True):
        mine.shutdown()
        other.shutdown()
