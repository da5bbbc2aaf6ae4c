"""Drawing worker scenarios from vLLM's space, and the references they are checked against.

- `draw_case(rng)`: KV tensors as vLLM's connector registers them (int8 or typed views of
  noise-filled allocations at any byte offset and block stride: separate allocations,
  several layers packed in one allocation per block, or a packed block registered whole),
  `CanonicalKVCacheRef`s with padded and short pages, groups aliasing the same tensors.
- `vllm_cpu_worker(kv, ...)`: vLLM 0.33.0's own `CPUOffloadingWorker` on CPU. Its pointer
  arithmetic, group / mid-chunk logic and byte counts run unchanged; only the device
  primitives are replaced: a tensor subclass answers `is_cuda`, streams and events are
  no-ops (every copy is done when submitted), `PIN_MEMORY` is off, and
  `ops.swap_blocks_batch` (a batched cudaMemcpy of `(src, dst, size)` pointer triples) is
  a loop of `ctypes.memmove` over the same triples.
- `Model`: vLLM's direct-layout semantics in plain numpy, written from its source
  (`_fill_direct_ops`, `compute_sub_block_ptrs`, `transfer_async`), for when vLLM's worker
  cannot be driven.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import random
import types
from dataclasses import dataclass, field

import numpy as np
import torch

DTYPES = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.uint8, torch.int8]


def noise(nbytes: int, rng: random.Random) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(rng.randbytes(nbytes), dtype=np.uint8).copy())


@dataclass
class TensorSpec:
    alloc: int  # which allocation
    offset: int  # bytes from the allocation start to block 0
    stride: int  # bytes between blocks
    page: int  # vLLM's (padded) page_size_bytes
    dtype: torch.dtype


@dataclass
class Case:
    seed: int
    allocs: list[int]  # allocation sizes in bytes
    num_blocks: int
    tensors: list[TensorSpec]
    refs: list[list[tuple[int, int]]]  # per group: (tensor_idx, unpadded page)
    bpc: int
    num_chunks: int
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        ts = [(t.alloc, t.offset, t.stride, t.page, str(t.dtype)[6:]) for t in self.tensors]
        return (
            f"seed={self.seed} {'+'.join(self.notes)} blocks={self.num_blocks} "
            f"bpc={self.bpc} chunks={self.num_chunks} tensors(alloc,off,stride,page,dtype)="
            f"{ts} refs={self.refs}"
        )


def _up(x: int, m: int) -> int:
    return -(-x // m) * m


def _separate(rng: random.Random, case: Case, n: int) -> None:
    for _ in range(rng.randint(1, 3)):
        dtype = rng.choice(DTYPES)
        item = dtype.itemsize
        page = item * rng.randint(1, 20)
        stride = page + item * rng.choice([0, 0, 0, rng.randint(1, 6)])  # gaps between blocks
        prefix = item * rng.choice([0, 0, rng.randint(1, 30)])  # the view starts mid-allocation
        case.tensors.append(TensorSpec(len(case.allocs), prefix, stride, page, dtype))
        case.allocs.append(prefix + n * stride + rng.randint(0, 9))
    case.notes.append("separate")


def _packed(rng: random.Random, case: Case, n: int, whole: bool) -> None:
    """Several layers per block in one allocation, at arbitrary (element-aligned) byte
    offsets: DSv4-like packing and hybrid pages of unrelated sizes."""
    layers, cursor = [], 0
    for _ in range(rng.randint(2, 4)):
        dtype = rng.choice(DTYPES)
        item = dtype.itemsize
        cursor = _up(cursor + rng.choice([0, 0, rng.randint(1, 7)]), item)
        page = item * rng.randint(1, 16)
        layers.append((cursor, page, dtype))
        cursor += page
    stride = _up(cursor + rng.choice([0, rng.randint(1, 9)]), 2)
    prefix = 2 * rng.choice([0, rng.randint(1, 20)])
    alloc = len(case.allocs)
    case.allocs.append(prefix + n * stride + rng.randint(0, 5))
    if whole:  # vLLM's packed registration: the whole block is one page
        case.tensors.append(TensorSpec(alloc, prefix, stride, stride, torch.int8))
        case.notes.append("packed-whole")
    else:
        for off, page, dtype in layers:
            case.tensors.append(TensorSpec(alloc, prefix + off, stride, page, dtype))
        case.notes.append("packed-layers")


def draw_case(seed: int) -> Case:
    rng = random.Random(seed)
    n = rng.randint(4, 12)
    case = Case(seed, [], n, [], [], rng.randint(1, 4), rng.randint(3, 8))
    kind = rng.choice(["separate", "packed", "packed-whole", "mixed"])
    if kind in ("separate", "mixed"):
        _separate(rng, case, n)
    if kind in ("packed", "mixed"):
        _packed(rng, case, n, whole=False)
    if kind == "packed-whole":
        _packed(rng, case, n, whole=True)
    for _ in range(rng.randint(1, 3)):
        group = []
        for _ in range(rng.randint(1, 3)):
            t = rng.randrange(len(case.tensors))
            page = case.tensors[t].page
            roll = rng.random()  # full page, short (padded) page, or an empty ref
            width = page if roll < 0.5 else rng.randint(1, page) if roll < 0.95 else 0
            group.append((t, width))
        case.refs.append(group)
    return case


# -- the tensors ------------------------------------------------------------------------


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA (vLLM's handler asserts `is_cuda`)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def registered(storage: torch.Tensor, spec: TensorSpec, n: int, cuda: bool = False):
    """The tensor vLLM's connector would register: `(num_blocks, page)` in the spec's
    dtype over `storage` at the spec's byte offset and block stride."""
    item = spec.dtype.itemsize
    t = torch.empty(0, dtype=spec.dtype).set_(
        storage.untyped_storage(),
        spec.offset // item,
        (n, spec.page // item),
        (spec.stride // item, 1),
    )
    return FakeCuda._make_subclass(FakeCuda, t) if cuda else t


def kv_caches(base, storages, case: Case, cuda: bool = False):
    return base.CanonicalKVCaches(
        [
            base.CanonicalKVCacheTensor(
                registered(storages[s.alloc], s, case.num_blocks, cuda), s.page
            )
            for s in case.tensors
        ],
        [[base.CanonicalKVCacheRef(t, w) for t, w in group] for group in case.refs],
    )


# -- vLLM's own worker on CPU ------------------------------------------------------------


class _Event:
    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.0


class _Stream:
    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


def _swap_blocks_batch(src, dst, sizes, is_src_access_order_any: bool = False) -> None:
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
        ctypes.memmove(d, s, n)


@contextlib.contextmanager
def vllm_on_cpu(monkeypatch):
    """Patches vLLM's worker module so its CPUOffloadingWorker runs on CPU tensors."""
    import vllm.v1.kv_offload.cpu.gpu_worker as gw

    platform = types.SimpleNamespace(
        Stream=_Stream,
        current_stream=_Stream,
        stream=lambda s: contextlib.nullcontext(),
        is_xpu=lambda: False,
        is_rocm=lambda: False,
        is_cuda_alike=lambda: True,
    )
    with monkeypatch.context() as m:
        m.setattr(gw, "current_platform", platform)
        m.setattr(gw, "PIN_MEMORY", False)
        m.setattr(gw, "ops", types.SimpleNamespace(swap_blocks_batch=_swap_blocks_batch))
        m.setattr(torch, "Event", _Event)
        yield gw.CPUOffloadingWorker


# -- the numpy model -------------------------------------------------------------------


class Model:
    """vLLM 0.33.0's direct layout in numpy: host tensor t is `[num_chunks, bpc * page]`;
    per group, block k of the group sits in slot `skip + k` (`skip = block_index % bpc`)
    of the group's chunk list; per ref, `ref.page_size_bytes` bytes are copied between
    the start of the device block's row and the start of its host slot; the size counts
    every ref."""

    def __init__(self, case: Case, storages: list[np.ndarray]) -> None:
        self.case, self.dev = case, storages
        self.host = [np.zeros((case.num_chunks, case.bpc * s.page), np.uint8) for s in case.tensors]

    def run(self, store: bool, gpu: list[int], sizes, starts, cpu: list[int]) -> int:
        bpc, size, b_off, c_off = self.case.bpc, 0, 0, 0
        for g, (n, start) in enumerate(zip(sizes, starts, strict=True)):
            if n == 0:
                continue
            skip = start % bpc
            count = math.ceil((n + skip) / bpc)
            blocks, chunks = gpu[b_off : b_off + n], cpu[c_off : c_off + count]
            b_off, c_off = b_off + n, c_off + count
            for t, w in self.case.refs[g]:
                spec = self.case.tensors[t]
                dev = self.dev[spec.alloc]
                for k, b in enumerate(blocks):
                    c, j = chunks[(skip + k) // bpc], (skip + k) % bpc
                    d = spec.offset + b * spec.stride
                    h = self.host[t][c, j * spec.page : j * spec.page + w]
                    if store:
                        h[...] = dev[d : d + w]
                    else:
                        dev[d : d + w] = h
                size += n * w
        assert (b_off, c_off) == (len(gpu), len(cpu))
        return size
