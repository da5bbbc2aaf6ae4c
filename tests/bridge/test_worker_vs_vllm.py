"""Our vLLM worker side by side with vLLM 0.33.0's own `CPUOffloadingWorker`.

Every case draws KV tensors from vLLM's space (`worker_twins.draw_case`: noise-filled
allocations, tensors at arbitrary byte offsets and block strides, several layers packed
in one allocation, padded and short pages, groups aliasing tensors, bf16/fp16/fp8/int8/
uint8 views) and runs random rounds of stores and loads through vLLM's worker interface
(vLLM's `CanonicalKVCaches`, `GPULoadStoreSpec` with group sizes and mid-chunk block
indices, `CPULoadStoreSpec`, job ids, `wait`, `get_finished`) on three copies of the same
bytes: our `JaxOffloadingWorker`, vLLM's worker run on CPU (`worker_twins.vllm_on_cpu`),
and a numpy model of vLLM's semantics. After every round: the same results in the same
order (job id, success, `transfer_size`), the same bytes in every allocation, loaded
ranges holding the bytes stored into their slots, every other byte unchanged.

Replay a failure with the seed its message prints:
`JAX_KVOFFLOAD_WORKER_SEED=<seed> python -m pytest tests/bridge/test_worker_vs_vllm.py`.
`JAX_KVOFFLOAD_WORKER_CASES` sets the number of cases (default 240).
"""

from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed")

from vllm.v1.kv_offload import base  # noqa: E402
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402

from jax_kvoffload.bridge import vllm as bridge  # noqa: E402
from tests.bridge.worker_twins import Model, draw_case, kv_caches, noise, vllm_on_cpu  # noqa: E402

pytestmark = pytest.mark.vllm

CASES = int(os.environ.get("JAX_KVOFFLOAD_WORKER_CASES", "240"))
SEED = int(os.environ.get("JAX_KVOFFLOAD_WORKER_SEED", random.SystemRandom().randrange(2**31)))
BATCHES = 8

print(f"worker differential suite: JAX_KVOFFLOAD_WORKER_SEED={SEED}, {CASES} cases")


class Slots:
    """What each host slot should hold: `(tensor, chunk, slot)` -> the bytes last stored
    there (zeros before), independent of how either worker lays out its host memory."""

    def __init__(self, case):
        self.case, self.rec = case, {}

    def get(self, t, c, j):
        return self.rec.setdefault((t, c, j), np.zeros(self.case.tensors[t].page, np.uint8))

    def apply(self, store, dev, gpu, sizes, starts, cpu):
        """Records a store from `dev`, or writes a load's expected bytes into `dev`."""
        bpc, b_off, c_off = self.case.bpc, 0, 0
        for g, (n, start) in enumerate(zip(sizes, starts, strict=True)):
            if n == 0:
                continue
            skip = start % bpc
            count = math.ceil((n + skip) / bpc)
            blocks, chunks = gpu[b_off : b_off + n], cpu[c_off : c_off + count]
            b_off, c_off = b_off + n, c_off + count
            for t, w in self.case.refs[g]:
                spec = self.case.tensors[t]
                for k, b in enumerate(blocks):
                    rec = self.get(t, chunks[(skip + k) // bpc], (skip + k) % bpc)
                    d = spec.offset + b * spec.stride
                    if store:
                        rec[:w] = dev[spec.alloc][d : d + w]
                    else:
                        dev[spec.alloc][d : d + w] = rec[:w]


def draw_job(rng, case, store, stored):
    """One job's specs: per group a size (0 for some), a block index (mid-chunk starts),
    device blocks (a load writes each block once) and the group's chunk ids (a store
    writes each chunk once; a load mostly reads back what a store of its group wrote)."""
    bpc, nb = case.bpc, case.num_blocks
    sizes, starts, gpu, cpu = [], [], [], []
    free_blocks = rng.sample(range(nb), nb)
    free_chunks = rng.sample(range(case.num_chunks), case.num_chunks)
    for g in range(len(case.refs)):
        n, start, chunks = 0, rng.randint(0, 3 * bpc), []
        if rng.random() < 0.8:
            if not store and stored[g] and rng.random() < 0.75:
                old, skip, stored_n = rng.choice(stored[g])
                n = rng.randint(1, stored_n)
                start = skip + bpc * rng.randint(0, 2)
                chunks = old[: math.ceil((n + skip) / bpc)]
            else:
                n = rng.randint(1, 2 * bpc + 1)
                count = math.ceil((n + start % bpc) / bpc)
                if store:
                    chunks = [free_chunks.pop() for _ in range(min(count, len(free_chunks)))]
                else:
                    chunks = [rng.randrange(case.num_chunks) for _ in range(count)]
                if len(chunks) < count:
                    n, chunks = 0, []
        if n and store:
            ids = [rng.randrange(nb) for _ in range(n)]  # a store may read a block twice
        elif n:
            n = min(n, len(free_blocks))
            ids = [free_blocks.pop() for _ in range(n)]
            chunks = chunks[: math.ceil((n + start % bpc) / bpc)] if n else []
        else:
            ids = []
        if store and n:
            stored[g].append((chunks, start % bpc, n))
        sizes.append(n)
        starts.append(start)
        gpu += ids
        cpu += chunks
    return gpu, sizes, starts, cpu


def run_case(seed, vllm_worker, store_kernel=None, dma=None):
    case = draw_case(seed)
    where = case.describe()
    rng = random.Random(seed ^ 0x5EED)
    allocs = [noise(n, rng) for n in case.allocs]
    ours_dev = [a.clone() for a in allocs]
    theirs_dev = [a.clone() for a in allocs]
    model = Model(case, [a.numpy().copy() for a in allocs])
    slots = Slots(case)
    expected = [a.numpy().copy() for a in allocs]
    kw = {"blocks_per_chunk": case.bpc, "num_chunks": case.num_chunks}
    if store_kernel is None and dma is None:
        ours = bridge.JaxOffloadingWorker.from_canonical(kv_caches(base, ours_dev, case), **kw)
    else:
        kv = kv_caches(base, ours_dev, case)
        ours = bridge.JaxOffloadingWorker(
            [(t.tensor, t.page_size_bytes) for t in kv.tensors],
            [[(r.tensor_idx, r.page_size_bytes) for r in g] for g in kv.group_data_refs],
            result_type=base.TransferResult,
            store_kernel=store_kernel,
            dma=dma,
            max_bucket=4,  # few compiled shapes, several buckets per move
            **kw,
        )
    theirs = None
    if vllm_worker is not None:
        theirs = vllm_worker(
            kv_caches(base, theirs_dev, case, cuda=True), case.bpc, case.num_chunks
        )
    # Host memory: the widest unpadded page per tensor (vLLM reserves the padded page).
    widths = {}
    for group in case.refs:
        for t, w in group:
            if w:
                widths[t] = max(widths.get(t, 0), w)
    assert ours.pool.bytes_per_block == dict(sorted(widths.items())), where
    stored = [[] for _ in case.refs]
    job = rng.randint(0, 100)
    try:
        for _ in range(rng.randint(4, 8)):
            kind = rng.choice(["store", "store", "load", "expedited"])
            store = kind == "store"
            ids, want = [], []
            for _ in range(rng.randint(1, 3)):
                gpu, sizes, starts, cpu = draw_job(rng, case, store, stored)
                job += rng.randint(1, 3)
                ids.append(job)
                size = model.run(store, gpu, sizes, starts, cpu)
                slots.apply(store, expected, gpu, sizes, starts, cpu)
                want.append((job, True, size))
                specs = [base.GPULoadStoreSpec(gpu, sizes, starts), CPULoadStoreSpec(cpu)]
                for w in (ours, theirs):
                    if w is None:
                        continue
                    if store:
                        assert w.submit_store(job, *specs)
                    else:
                        assert w.submit_load(job, specs[1], specs[0], kind == "expedited")
            for w in (ours, theirs):
                if w is None:
                    continue
                w.wait(set(ids))
                got = [(r.job_id, r.success, r.transfer_size) for r in w.get_finished()]
                assert got == want, (where, kind, w, got, want)
            for i, (mine, other) in enumerate(zip(ours_dev, theirs_dev, strict=True)):
                mine = mine.numpy()
                diff = np.flatnonzero(mine != model.dev[i])
                assert diff.size == 0, (where, kind, f"alloc {i} bytes {diff[:8]} differ")
                np.testing.assert_array_equal(mine, expected[i], err_msg=where)
                if theirs is not None:
                    np.testing.assert_array_equal(mine, other.numpy(), err_msg=where)
    finally:
        ours.shutdown()
        if theirs is not None:
            theirs.shutdown()


@pytest.fixture
def vllm_worker(monkeypatch):
    """Builds vLLM's own worker on CPU; None where this vLLM cannot be patched so (the
    cases then run against the numpy model alone, and say so)."""
    try:
        patched = vllm_on_cpu(monkeypatch)
        cls = patched.__enter__()
    except (AttributeError, ImportError) as e:  # a worker module unlike 0.33.0's
        print(f"vLLM's worker cannot run on CPU here ({e}); comparing with the model only")
        yield None
        return

    def build(kv, bpc, num_chunks):
        return cls(kv, blocks_per_chunk=bpc, num_cpu_chunks=num_chunks)

    try:
        yield build
    finally:
        patched.__exit__(None, None, None)


def _seeds(batch, cases, offset=0):
    return [SEED + offset + i for i in range(batch, cases, BATCHES)]


@pytest.mark.parametrize("batch", range(BATCHES))
def test_worker_moves_the_bytes_vllms_worker_moves(batch, vllm_worker):
    for seed in _seeds(batch, CASES):
        run_case(seed, vllm_worker)


@pytest.mark.parametrize("batch", range(2))
def test_the_gather_kernel_path_moves_the_same_bytes(batch, vllm_worker):
    # Accelerator tensors are stored through our gather kernel over `[rows, unit]` views
    # of their storage; forced here on CPU (fewer cases: every shape compiles).
    for seed in [SEED + 10**6 + batch + 2 * i for i in range(max(2, CASES // 40))]:
        run_case(seed, vllm_worker, store_kernel=True)


@pytest.mark.parametrize("batch", range(2))
def test_the_copy_engine_path_moves_the_same_bytes(batch, vllm_worker):
    # Accelerator tensors take the copy-engine path (gathers, D2H / H2D copies per run
    # of slots, scatters on the worker's streams); forced here on CPU, where its
    # streams are the synchronous stand-in.
    for seed in [SEED + 2 * 10**6 + batch + 2 * i for i in range(max(2, CASES // 8))]:
        run_case(seed, vllm_worker, dma=True)


def test_vllms_worker_runs_on_cpu_as_the_model_says(vllm_worker):
    if vllm_worker is None:
        pytest.skip("this vLLM's worker cannot be driven on CPU")
    # The harness itself: vLLM's worker (patched to CPU) and the numpy model agree on
    # a padded page and a mid-chunk start (bpc 3, block index 2, as vLLM's gpu_worker.py allows).
    from tests.bridge.worker_twins import Case, TensorSpec

    case = Case(0, [100], 4, [TensorSpec(0, 4, 24, 20, torch.int8)], [[(0, 13)]], 3, 4)
    dev = noise(100, random.Random(1))
    theirs_dev = dev.clone()
    theirs = vllm_worker(kv_caches(base, [theirs_dev], case, cuda=True), 3, 4)
    model = Model(case, [dev.numpy().copy()])
    gpu, cpu = base.GPULoadStoreSpec([1, 2], [2], [2]), CPULoadStoreSpec([3, 1])
    assert theirs.submit_store(1, gpu, cpu)
    assert [(r.job_id, r.transfer_size) for r in theirs.get_finished()] == [(1, 26)]
    assert model.run(True, [1, 2], [2], [2], [3, 1]) == 26
    assert theirs.submit_load(2, cpu, base.GPULoadStoreSpec([0, 3], [2], [2]))
    theirs.get_finished()
    model.run(False, [0, 3], [2], [2], [3, 1])
    np.testing.assert_array_equal(theirs_dev.numpy(), model.dev[0])
    # Block 0 took block 1's 13 leading bytes; its padding (7 bytes) and gap kept noise.
    np.testing.assert_array_equal(theirs_dev[4:17].numpy(), dev[28:41].numpy())
    np.testing.assert_array_equal(theirs_dev[17:28].numpy(), dev[17:28].numpy())
    theirs.shutdown()
