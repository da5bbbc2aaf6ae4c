"""The torch bridge on CPU tensors: DLPack views, raw pages, job plans, worker round trips.

Bytes are compared exactly. The worker scenarios are checked against a trivially correct
model of the host tier: a dict from (tensor, chunk, slot) to the block's bytes.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jax_kvoffload.bridge.torch import (  # noqa: E402
    GappedLayoutError,
    JobSpecError,
    JobSpecTypeError,
    NarrowingDTypeError,
    TorchKVWorker,
    WorkerClosedError,
    plan_job,
    raw_pages,
    to_jax,
    to_torch,
)
from jax_kvoffload.errors import KVOffloadError, KVOffloadTypeError  # noqa: E402
from jax_kvoffload.hostmem import HostPoolError  # noqa: E402

DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
]


def random_tensor(shape, dtype, gen):
    """Random bits of any dtype (NaN payloads included: the bridge moves bits)."""
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def as_bytes(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dlpack_views_are_zero_copy_both_ways(dtype):
    t = random_tensor((4, 16, 2, 8), dtype, torch.Generator().manual_seed(0))
    a = to_jax(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert a.shape == tuple(t.shape)
    back = to_torch(a)
    assert back.data_ptr() == t.data_ptr() and back.dtype == dtype
    assert torch.equal(as_bytes(back), as_bytes(t))


def test_64_bit_tensors_are_refused_not_narrowed():
    # Without jax_enable_x64 JAX narrows 64-bit values: 2**40 + 1 would arrive as 1.
    import jax

    assert not jax.config.jax_enable_x64
    for t in (
        torch.tensor([2**40 + 1], dtype=torch.int64),
        torch.tensor([0.1], dtype=torch.float64),
        torch.tensor([1 + 2j], dtype=torch.complex128),
    ):
        with pytest.raises(NarrowingDTypeError, match="jax_enable_x64") as e:
            to_jax(t)
        assert isinstance(e.value, KVOffloadTypeError) and isinstance(e.value, TypeError)
    # 32-bit words carry the same bits exactly.
    words = to_jax(torch.tensor([2**40 + 1], dtype=torch.int64).view(torch.int32))
    assert np.asarray(words).view(np.int64).tolist() == [2**40 + 1]
    assert to_jax(torch.tensor([1 + 2j], dtype=torch.complex64)).dtype == np.complex64


def test_an_unaligned_view_is_refused_rather_than_silently_copied():
    # Measured: XLA copies a buffer that does not start on a 64-byte boundary, so the
    # "view" would never see later writes (a store would read a stale snapshot).
    base = torch.zeros(4096, dtype=torch.uint8)
    for offset in (3, 16):
        with pytest.raises(GappedLayoutError, match="64-byte aligned"):
            to_jax(base[offset : offset + 100])
    view = to_jax(base[64:164])
    base[64] = 7
    assert int(np.asarray(view)[0]) == 7  # a view, not a copy


def test_bridge_entries_refuse_wrong_types_with_our_errors():
    with pytest.raises(KVOffloadTypeError, match=r"torch\.Tensor"):
        to_jax(np.zeros(4))
    with pytest.raises(KVOffloadTypeError, match=r"jax\.Array"):
        to_torch(np.zeros(4))
    with pytest.raises(KVOffloadTypeError, match=r"torch\.Tensor"):
        raw_pages([1, 2, 3])
    with pytest.raises(KVOffloadTypeError, match="block_axis"):
        raw_pages(torch.zeros(4, 4), block_axis=0.0)
    with pytest.raises(KVOffloadTypeError, match="page_size_bytes"):
        TorchKVWorker([(torch.zeros(4, 4), 4.0)], [[(0, 4)]], blocks_per_chunk=1, num_chunks=1)
    with pytest.raises(GappedLayoutError, match=r"cannot be viewed as bytes \(-1, 5\)"):
        TorchKVWorker([(torch.zeros(4, 4), 5)], [[(0, 4)]], blocks_per_chunk=1, num_chunks=1)
    with pytest.raises(KVOffloadTypeError, match=r"tensors\[0\] must be a pair"):
        TorchKVWorker([torch.zeros(4, 4)], [[(0, 4)]], blocks_per_chunk=1, num_chunks=1)
    with pytest.raises(KVOffloadTypeError, match=r"group_refs\[0\]\[0\] must be a pair"):
        TorchKVWorker([(torch.zeros(4, 4), 16)], [[0]], blocks_per_chunk=1, num_chunks=1)
    for group in (5, None, "ab"):  # not a list of refs: named, not "not iterable"
        with pytest.raises(KVOffloadTypeError, match=r"group_refs\[1\] must be a list"):
            TorchKVWorker(
                [(torch.zeros(4, 4), 16)], [[(0, 16)], group], blocks_per_chunk=1, num_chunks=1
            )
    with pytest.raises(JobSpecError, match="fit its page"):
        TorchKVWorker([(torch.zeros(4, 4), 16)], [[(0, 17)]], blocks_per_chunk=1, num_chunks=1)
    for error in (GappedLayoutError, JobSpecError, JobSpecTypeError, NarrowingDTypeError):
        assert issubclass(error, KVOffloadError)


def test_permuted_views_import_and_gapped_views_are_refused_with_the_layout():
    base = torch.zeros((2, 12, 4, 2, 8), dtype=torch.float16)  # [2, num_blocks, ...]
    to_jax(base.permute(1, 0, 2, 3, 4))  # a pure permutation: compact, imports
    with pytest.raises(GappedLayoutError, match=r"shape \(2, 7, 4, 2, 8\).*raw_pages"):
        to_jax(base[:, 3:10])
    with pytest.raises(GappedLayoutError, match="gaps"):
        to_jax(base[0, ::2])


def test_raw_pages_address_k_and_v_pages_of_a_kv_outermost_block_range():
    gen = torch.Generator().manual_seed(1)
    base = random_tensor((2, 12, 4, 2, 8), torch.bfloat16, gen)
    view = base[:, 3:10]  # blocks 3..9 of K and V: gapped strides
    rp = raw_pages(view, block_axis=1)
    assert rp.page_bytes == 4 * 2 * 8 * 2 and rp.num_blocks == 7
    assert rp.rows.data_ptr() == base.data_ptr()  # the whole allocation, not a copy
    for b in range(7):
        k_row, v_row = rp.block_rows[b]
        assert torch.equal(rp.rows[k_row], as_bytes(view[0, b]).reshape(-1))
        assert torch.equal(rp.rows[v_row], as_bytes(view[1, b]).reshape(-1))
    assert rp.rows_of([2, 0]).tolist() == [*rp.block_rows[2], *rp.block_rows[0]]
    with pytest.raises(JobSpecTypeError, match="integers"):
        rp.rows_of([2.9])  # not block 2
    with pytest.raises(JobSpecError, match="outside"):
        rp.rows_of([7])


def test_raw_pages_refuse_scattered_pages_and_unaligned_block_strides():
    base = torch.zeros((8, 4, 16), dtype=torch.float16)
    with pytest.raises(GappedLayoutError, match="row-major contiguous"):
        raw_pages(base.transpose(1, 2))  # a page is spread over memory
    packed = torch.zeros((8, 3, 10), dtype=torch.uint8)  # 3 interleaved 10-byte layers
    assert raw_pages(packed[:, 1, :]).rows_of([0, 1, 2]).tolist() == [1, 4, 7]
    uneven = torch.zeros((8, 25), dtype=torch.uint8)  # layers of 5 and 10 bytes, then pad
    with pytest.raises(GappedLayoutError, match="not multiples"):
        raw_pages(uneven[:, 5:15])  # pages start at byte 5 + 25 b: not on a 10-byte grid


def test_plan_starts_and_ends_mid_chunk_like_vllms_handler():
    # Spec 5.5: bpc 3, chunks [7, 9], block_index 2 -> sub-blocks (7,2), (9,0), (9,1), (9,2).
    moves, size = plan_job([10, 11, 12, 13], [4], [2], [7, 9], [[(0, 64)]], 3)
    assert [(m.tensor, m.block_ids, m.chunk_ids, m.first_slot) for m in moves] == [
        (0, (10, 11, 12, 13), (7, 9), 2)
    ]
    assert size == 4 * 64


def test_plan_skips_empty_groups_and_moves_aliased_tensors_once():
    refs = [[(0, 64), (1, 32)], [(2, 64)], [(0, 48), (0, 64)]]
    moves, size = plan_job([0, 1, 2, 20, 21], [3, 0, 2], [0, 5, 3], [2, 5, 7, 9], refs, 2)
    assert [(m.tensor, m.block_ids, m.chunk_ids, m.first_slot, m.width, m.refs) for m in moves] == [
        (0, (0, 1, 2), (2, 5), 0, 64, 1),
        (1, (0, 1, 2), (2, 5), 0, 32, 1),
        (0, (20, 21), (7, 9), 1, 64, 2),  # aliased refs: the widest page, counted twice
    ]
    assert size == 3 * 96 + 2 * 112  # vLLM counts every ref's unpadded page


@pytest.mark.parametrize(
    "ids",
    [[1.0, 2.0], np.array([1.5, 2.5]), [1, 2.7], [True, False], ["1", "2"], np.zeros((1, 2))],
    ids=repr,
)
def test_plan_refuses_ids_that_are_not_integers_instead_of_truncating(ids):
    # np.asarray([2.7], dtype=np.int64) is [2]: a float id would move another block.
    with pytest.raises(JobSpecTypeError, match="integers") as e:
        plan_job(ids, [2], [0], [0], [[(0, 8)]], 2)
    assert isinstance(e.value, TypeError)
    with pytest.raises(JobSpecTypeError, match="integers"):
        plan_job([1, 2], [2.0], [0], [0], [[(0, 8)]], 2)
    with pytest.raises(JobSpecTypeError, match="integers"):
        plan_job([1, 2], [2], [0], ids, [[(0, 8)]], 2)


@pytest.mark.parametrize(
    ("sizes", "starts", "chunks", "match"),
    [
        ([2], [0, 0], [0], "needs one of each per group"),
        ([3], [0], [0], "sum to 3"),
        ([2], [1], [0], "need 2 chunks"),
        ([2], [0], [0, 1], "lists 2 chunk ids but its groups use 1"),
    ],
)
def test_plan_refuses_inconsistent_specs(sizes, starts, chunks, match):
    with pytest.raises(JobSpecError, match=match):
        plan_job([4, 5], sizes, starts, chunks, [[(0, 8)]], 2)


def spec(block_ids, sizes=None, starts=None):
    return SimpleNamespace(
        block_ids=np.asarray(block_ids, dtype=np.int32), group_sizes=sizes, block_indices=starts
    )


def run_random_jobs(dtype, seed, *, bpc, num_jobs, store_kernel=None):
    """Random stores and loads over 3 groups (two share a tensor) vs the model."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    nb, num_chunks = 24, 10
    shapes = [(nb, 4, 2, 8), (nb, 4, 2, 8), (nb, 4, 16)]  # two layers, one MLA-like
    tensors = [random_tensor(s, dtype, gen) for s in shapes]
    pages = [int(np.prod(s[1:])) * tensors[0].element_size() for s in shapes]
    refs = [[(0, pages[0]), (1, pages[1])], [(2, pages[2])], [(0, pages[0])]]
    worker = TorchKVWorker(
        [(t, p) for t, p in zip(tensors, pages)],
        refs,
        blocks_per_chunk=bpc,
        num_chunks=num_chunks,
        store_kernel=store_kernel,
    )
    host: dict[tuple[int, int, int], torch.Tensor] = {}  # (tensor, chunk, slot) -> bytes
    stored: list[tuple[int, tuple[int, ...], int, int]] = []  # (group, chunks, first, n)
    try:
        for job in range(num_jobs):
            groups = rng.sample(range(3), rng.randint(1, 3))
            sizes, starts, blocks, chunks, plan = [0, 0, 0], [0, 0, 0], [], [], []
            free = rng.sample(range(num_chunks), num_chunks)
            ids_pool = rng.sample(range(nb), nb)
            for g in sorted(groups):
                n, first = rng.randint(1, 2 * bpc), rng.randrange(bpc)
                count = -(-(n + first) // bpc)
                if len(free) < count:
                    break
                sizes[g], starts[g] = n, first + bpc * rng.randrange(3)
                ids = [ids_pool.pop() for _ in range(n)]
                cs = [free.pop() for _ in range(count)]
                blocks += ids
                chunks += cs
                plan.append((g, ids, cs, first))
            if rng.random() < 0.6 or not stored:  # a store
                worker.submit_store(job, spec(blocks, sizes, starts), spec(chunks))
                worker.wait({job})
                for g, ids, cs, first in plan:
                    for tensor in {t for t, _ in refs[g]}:
                        for k, b in enumerate(ids):
                            slot = first + k
                            key = (tensor, cs[slot // bpc], slot % bpc)
                            host[key] = as_bytes(tensors[tensor][b]).clone()
                    stored.append((g, tuple(cs), first, len(ids)))
            else:  # a load of slots the model knows, into random blocks
                g, cs, first, n = rng.choice(stored)
                sizes, starts = [0, 0, 0], [0, 0, 0]
                sizes[g], starts[g] = n, first
                ids = rng.sample(range(nb), n)
                before = [t.clone() for t in tensors]
                worker.submit_load(job, spec(cs), spec(ids, sizes, starts), rng.random() < 0.3)
                worker.wait({job})
                touched = {t for t, _ in refs[g]}
                for tensor, t in enumerate(tensors):
                    for b in range(nb):
                        if tensor in touched and b in ids:
                            slot = first + ids.index(b)
                            want = host[(tensor, cs[slot // bpc], slot % bpc)]
                        else:
                            want = as_bytes(before[tensor][b])
                        assert torch.equal(as_bytes(t[b]), want), (job, tensor, b)
            (result,) = worker.get_finished()
            assert result.job_id == job and result.success and result.transfer_time >= 0
    finally:
        worker.shutdown()
    return len(stored)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_worker_round_trips_random_jobs_bit_exactly(dtype):
    assert run_random_jobs(dtype, seed=DTYPES.index(dtype), bpc=3, num_jobs=8) > 0


def test_worker_round_trips_with_one_block_per_chunk():
    assert run_random_jobs(torch.float16, seed=11, bpc=1, num_jobs=8) > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e5m2], ids=str)
def test_worker_round_trips_through_the_gather_kernel(dtype):
    # The accelerator store path (gather kernel over DLPack rows), forced on CPU.
    assert run_random_jobs(dtype, seed=21, bpc=2, num_jobs=8, store_kernel=True) > 0


def test_worker_reports_job_sizes_like_vllm_and_refuses_bad_specs():
    t = torch.zeros((8, 64), dtype=torch.int8)
    worker = TorchKVWorker([(t, 64)], [[(0, 48)]], blocks_per_chunk=2, num_chunks=4)
    try:
        assert worker.widths == {0: 48} and worker.pool.bytes_per_block == {0: 48}
        worker.submit_store(1, spec([1, 2, 3], [3], [1]), spec([0, 1]))
        worker.wait([1])
        (r,) = worker.get_finished()
        assert (r.job_id, r.success, r.transfer_size) == (1, True, 3 * 48)  # unpadded pages
        with pytest.raises(JobSpecError, match="need 2 chunks"):
            worker.submit_store(2, spec([1, 2], [2], [1]), spec([0]))
        with pytest.raises(JobSpecError, match=r"block ids \[8\] are outside \[0, 8\)"):
            worker.submit_store(2, spec([1, 8], [2], [0]), spec([0]))
        with pytest.raises(HostPoolError, match=r"chunk ids \[4\]"):
            worker.submit_store(2, spec([1, 2], [2], [0]), spec([4]))
        with pytest.raises(JobSpecTypeError, match="integers"):
            worker.submit_load(2, spec([0]), SimpleNamespace(block_ids=[1.0, 2.0]))
        with pytest.raises(JobSpecError, match="more than once"):
            worker.submit_load(2, spec([0]), spec([3, 3], [2], [0]))
        gate = threading.Event()
        worker._core._threads["store"].submit(gate.wait)  # hold the store thread
        worker.submit_store(2, spec([1], [1], [0]), spec([0]))
        with pytest.raises(JobSpecError, match="already in flight"):
            worker.submit_store(2, spec([1], [1], [0]), spec([1]))
        gate.set()
        worker.wait({2})
        assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, True)]
    finally:
        worker.shutdown()
    with pytest.raises(WorkerClosedError, match="shut down"):
        worker.submit_load(3, spec([0]), spec([1], [1], [0]))


def test_importing_the_torch_bridge_does_not_import_torch():
    code = "import sys, jax_kvoffload.bridge.torch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_load_that_fails_is_reported_and_leaves_the_tensors_alone():
    # Two tensors: the second read fails after the first succeeded; every slot is read
    # before any device byte is written, so neither tensor changes.
    ts = [torch.arange(8 * 16, dtype=torch.int16).reshape(8, 16) for _ in range(2)]
    before = [t.clone() for t in ts]
    worker = TorchKVWorker(
        [(t, 32) for t in ts], [[(0, 32), (1, 32)]], blocks_per_chunk=1, num_chunks=2
    )
    try:
        read = worker.pool.read_blocks

        def failing(group, *args):
            if group == 1:
                raise OSError("host memory went away")
            return read(group, *args)

        worker.pool.read_blocks = failing
        worker.submit_load(5, spec([1]), spec([3], [1], [0]))
        worker.wait({5})
        (r,) = worker.get_finished()
        assert (r.job_id, r.success, r.transfer_size) == (5, False, 64)
        for t, b in zip(ts, before, strict=True):
            assert torch.equal(t, b)
    finally:
        worker.shutdown()
