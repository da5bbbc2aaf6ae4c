"""Zero-copy torch <-> JAX views through DLPack, and raw page views of KV allocations.

Measured facts this module is built on (torch 2.13 + jax 0.10.2, on CPU):
DLPack imports every KV dtype (bf16, fp16, fp32, fp8 e4m3/e5m2, int8, uint8) without a
copy, in both directions; compact strides (contiguous or a pure permutation) import, any
stride with gaps is refused by XLA. Two silent traps are refused here instead: a tensor
whose data does not start on a 64-byte boundary is *copied* by the import (measured: a
uint8 view at byte offset 3 or 16 of an allocation), so the "view" would be a stale
snapshot; and without `jax_enable_x64` a 64-bit tensor is narrowed (int64 2**40 + 1
becomes 1, float64 becomes float32). So a per-layer view that skips bytes (a block range
of a `[2, num_blocks, ...]` allocation, a block-outermost cross-layer layout) is reached
through `raw_pages`: the whole backing allocation viewed as `[rows, page_bytes]` bytes,
plus the row of every (block, part). Nothing here ever copies a whole KV cache.

torch is imported lazily (inside the functions), so importing this module is cheap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from jax_kvoffload.errors import KVOffloadTypeError, KVOffloadValueError

if TYPE_CHECKING:
    import jax
    import torch

__all__ = [
    "GappedLayoutError",
    "NarrowingDTypeError",
    "RawPages",
    "raw_pages",
    "to_jax",
    "to_torch",
]

# XLA adopts an imported buffer only at this alignment; below it the import copies.
_XLA_ALIGNMENT = 64


class GappedLayoutError(KVOffloadValueError):
    """A tensor's memory cannot be viewed zero-copy the way that was asked."""


class NarrowingDTypeError(KVOffloadTypeError):
    """A 64-bit tensor would lose bits in JAX (`jax_enable_x64` is off)."""


def _is_compact(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """True when the strides are a permutation of a contiguous layout (no gaps)."""
    dims = sorted((s, n) for s, n in zip(strides, shape, strict=True) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


# Devices whose memory DLPack exports and JAX imports (torch's kDLCPU, kDLCUDA, kDLROCM).
# A meta tensor has no memory at all; other devices (mps, xpu, hpu, privateuse1) fail
# inside torch's exporter with an untyped ValueError, after our checks passed.
_DLPACK_DEVICES = ("cpu", "cuda")
# torch's bit types pack 1-7 bits per element: the kernels move whole bytes.
_SUB_BYTE = {f"{kind}{bits}": bits for kind in ("int", "uint") for bits in range(1, 8)}


class UnsupportedTensorError(KVOffloadValueError):
    """A tensor on a device DLPack cannot export, or of a sub-byte dtype."""


def check_tensor(tensor: object, name: str = "tensor") -> None:
    """Raises `KVOffloadTypeError` unless `tensor` is a torch tensor, and
    `UnsupportedTensorError` unless its memory can be exported (cpu, cuda) and its
    elements are whole bytes."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise KVOffloadTypeError(
            f"{name} must be a torch.Tensor, got {type(tensor).__name__}; wrap numpy data "
            "with torch.from_numpy first"
        )
    device = tensor.device.type
    if device not in _DLPACK_DEVICES:
        what = "has no memory (a meta tensor)" if device == "meta" else "is not one DLPack exports"
        raise UnsupportedTensorError(
            f"{name} is on device {str(tensor.device)!r}, which {what}: pass the tensor "
            f"the engine computes with, on one of {_DLPACK_DEVICES} (move it with .to('cpu'))"
        )
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype in _SUB_BYTE:
        raise UnsupportedTensorError(
            f"{name} has dtype {dtype} ({_SUB_BYTE[dtype]} bits per element), which the "
            "kernels cannot move (they move whole bytes); view the packed storage as "
            "uint8 words (tensor.view(torch.uint8)) and pass that"
        )


def to_jax(tensor: torch.Tensor) -> jax.Array:
    """The JAX array over `tensor`'s memory (no copy; any KV dtype).

    Raises:
      KVOffloadTypeError: `tensor` is not a torch tensor.
      NarrowingDTypeError: a 64-bit dtype (int64, uint64, float64, complex128) while
        `jax_enable_x64` is off: JAX would narrow the values (2**40 + 1 -> 1).
      GappedLayoutError: the strides have gaps (XLA imports only compact layouts), or
        the data does not start on a 64-byte boundary (XLA would copy it); view the
        allocation with `raw_pages` instead.
    """
    import jax

    check_tensor(tensor)
    item = tensor.element_size()
    wide = item == (16 if tensor.is_complex() else 8)
    if wide and not jax.config.jax_enable_x64:  # type: ignore[attr-defined]
        raise NarrowingDTypeError(
            f"a {tensor.dtype} tensor cannot be viewed in JAX without losing bits: with "
            "jax_enable_x64 off, JAX narrows 64-bit values (int64 2**40 + 1 becomes 1). "
            "Enable it (jax.config.update('jax_enable_x64', True)) or view the tensor as "
            "32-bit words first (tensor.view(torch.int32))"
        )
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    if not _is_compact(shape, strides):
        raise GappedLayoutError(
            f"a tensor of shape {shape} with strides {strides} (elements) has gaps between "
            "its elements, and DLPack/XLA import only compact layouts; a copy would "
            "duplicate the KV cache, so use raw_pages(tensor, block_axis) to view the "
            "backing allocation as pages instead"
        )
    if tensor.numel() and tensor.data_ptr() % _XLA_ALIGNMENT:
        raise GappedLayoutError(
            f"a tensor of shape {shape} starts at address {tensor.data_ptr():#x}, which is "
            f"not {_XLA_ALIGNMENT}-byte aligned, so XLA would import a copy (a stale "
            "snapshot, not a view); view the whole allocation from its start instead"
        )
    array = jax.dlpack.from_dlpack(tensor.detach())
    if tensor.numel() and array.unsafe_buffer_pointer() != tensor.data_ptr():
        raise GappedLayoutError(
            f"importing a tensor of shape {shape} {tensor.dtype} into JAX made a copy (the "
            "array is at another address), so it would not see later writes; pass a "
            "contiguous, aligned tensor"
        )
    return array


def to_torch(array: jax.Array) -> torch.Tensor:
    """The torch tensor over a JAX array's memory (no copy).

    Raises:
      KVOffloadTypeError: `array` is not a `jax.Array`.
    """
    import jax
    import torch

    if not isinstance(array, jax.Array):
        raise KVOffloadTypeError(
            f"array must be a jax.Array, got {type(array).__name__}; use torch.from_numpy "
            "for numpy data"
        )
    return torch.from_dlpack(array)


@dataclasses.dataclass(frozen=True)
class RawPages:
    """A KV tensor seen as whole-allocation pages.

    Attributes:
      rows: uint8 torch tensor `[num_rows, page_bytes]` over the tensor's whole storage
        (contiguous, so it imports into JAX without a copy).
      block_rows: int64 `[num_blocks, parts]`: the rows holding block b, in the order the
        tensor's outer dimensions list them (e.g. K then V for a `[2, num_blocks, ...]`
        tensor).
    """

    rows: torch.Tensor
    block_rows: np.ndarray

    @property
    def page_bytes(self) -> int:
        return int(self.rows.shape[1])

    @property
    def num_blocks(self) -> int:
        return int(self.block_rows.shape[0])

    def rows_of(self, block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Row ids of the given blocks, block-major (`[n * parts]`).

        Raises:
          JobSpecTypeError: an id is not an integer (a float would be truncated).
          JobSpecError: an id is negative or not below `num_blocks`.
        """
        from jax_kvoffload.bridge._job_plan import JobSpecError, int_ids

        ids = int_ids("block_ids", block_ids)
        bad = [b for b in ids if b >= self.num_blocks]
        if bad:
            raise JobSpecError(f"block ids {bad[:8]} are outside [0, {self.num_blocks})")
        return self.block_rows[np.asarray(ids, dtype=np.int64)].reshape(-1)


def raw_pages(tensor: torch.Tensor, block_axis: int = 0) -> RawPages:
    """Views `tensor`'s whole storage as pages of one block part each, without a copy.

    A page is the compact run of dimensions after `block_axis` (what one block holds
    per outer index); dimensions before it (e.g. the K/V axis of a `[2, num_blocks,
    ...]` layout) become extra parts per block.

    Raises:
      GappedLayoutError: the dimensions after `block_axis` are not one contiguous run,
        or page offsets are not multiples of the page size (e.g. interleaved layers whose
        block stride is not a whole number of pages), so whole-allocation rows cannot
        address them.
    """
    import torch

    check_tensor(tensor)
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    if isinstance(block_axis, bool) or not isinstance(block_axis, int):
        raise KVOffloadTypeError(f"block_axis must be an int, got {block_axis!r}")
    if not 0 <= block_axis < len(shape):
        raise GappedLayoutError(f"block_axis={block_axis} is outside a tensor of rank {len(shape)}")
    inner_shape, inner_strides = shape[block_axis + 1 :], strides[block_axis + 1 :]
    contiguous_inner = tuple(
        int(np.prod(inner_shape[i + 1 :], dtype=np.int64)) for i in range(len(inner_shape))
    )
    if any(
        n != 1 and s != c
        for n, s, c in zip(inner_shape, inner_strides, contiguous_inner, strict=True)
    ):
        raise GappedLayoutError(
            f"layout shape={shape} strides={strides}: the dims after block_axis={block_axis} "
            "must be row-major contiguous (one page per block part); this layout scatters a "
            "page across memory, so it cannot be moved as pages without copying the cache"
        )
    elem = tensor.element_size()
    page = int(np.prod(inner_shape, dtype=np.int64)) * elem
    storage = tensor.untyped_storage()
    total = storage.nbytes()
    outer = [np.arange(n, dtype=np.int64) * s * elem for n, s in zip(shape, strides, strict=True)]
    offsets = np.asarray(tensor.storage_offset() * elem, dtype=np.int64)
    # offsets[b, o...] = byte offset of block b, outer index o (block axis first).
    grid = np.ix_(outer[block_axis], *[outer[i] for i in range(block_axis)])
    for g in grid:
        offsets = offsets + g
    offsets = offsets.reshape(shape[block_axis], -1) if offsets.ndim else offsets
    if page == 0 or total % page or np.any(offsets % page):
        raise GappedLayoutError(
            f"layout shape={shape} strides={strides} storage_offset={tensor.storage_offset()} "
            f"({total} storage bytes): page offsets are not multiples of the {page}-byte page, "
            "so the allocation cannot be addressed as whole pages; pass a view whose block "
            "stride is a whole number of pages"
        )
    rows = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    rows.set_(storage, 0, (total // page, page), (page, 1))
    return RawPages(rows=rows, block_rows=(offsets // page).astype(np.int64))
