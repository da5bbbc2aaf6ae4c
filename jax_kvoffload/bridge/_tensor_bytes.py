"""A registered tensor's blocks as byte ranges of its storage, as vLLM's worker sees them.

vLLM 0.33.0's `CPUOffloadingWorker` views each `CanonicalKVCacheTensor` as
`tensor.view(torch.int8).view(-1, page_size_bytes)` and, per block and ref, copies the
ref's unpadded `page_size_bytes` from `data_ptr() + block * stride(0)`
(`vllm/v1/kv_offload/cpu/gpu_worker.py`).
So block b is bytes `[offset + b * stride, + width)` of the tensor's storage, whatever
the offsets: layers packed into one allocation at any byte offset, block-outermost
packed layouts, padded pages (width < page), views that several groups alias.

Neither direction copies the cache:

- loads (torch) write `block_view(width)`, a strided uint8 view `[num_blocks, width]`
  with the tensor's block stride, with one `index_copy_`;
- stores of CPU tensors read `host_blocks(width)`, the same view in numpy (the tensor
  already is host memory: one copy into the host slots);
- stores of accelerator tensors read with our gather kernel. XLA imports only compact
  memory that starts on a 64-byte boundary (else it silently copies: `_torch.to_jax`),
  so the tensor's span is imported once as `[rows, unit]` uint8 rows, `unit` the
  largest byte count dividing every block start and width (a whole page for ordinary
  layouts, so one row per block); block b of width w is the `w // unit` consecutive
  rows from `row0 + b * row_stride`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from jax_kvoffload.bridge._torch import GappedLayoutError, check_tensor, to_jax
from jax_kvoffload.errors import KVOffloadTypeError

if TYPE_CHECKING:
    import jax
    import torch

__all__ = ["TensorBytes", "UnitRows"]

_ALIGN = 64  # XLA adopts imported buffers at this alignment (see _torch.to_jax)
_MAX_ROWS = 2**31 - 1  # the gather kernels take int32 row ids


@dataclass(frozen=True)
class UnitRows:
    """A tensor's block bytes as rows of a JAX uint8 array `[rows, unit]` (no copy)."""

    array: jax.Array
    unit: int
    row0: int
    row_stride: int

    def rows_of(self, block_ids: np.ndarray, width: int) -> np.ndarray:
        """int32 row ids of `width` leading bytes of each block, block-major."""
        starts = self.row0 + np.asarray(block_ids, dtype=np.int64) * self.row_stride
        k = width // self.unit
        return (starts[:, None] + np.arange(k, dtype=np.int64)).reshape(-1).astype(np.int32)


@dataclass(frozen=True)
class TensorBytes:
    """Where the blocks of one registered tensor live in its storage.

    Attributes:
      storage: uint8 torch tensor over the whole storage (1-D, from byte 0).
      offset: bytes from the storage start to block 0's row.
      stride: bytes from one block's row to the next.
      num_blocks: rows of vLLM's `(-1, page)` view.
      page: vLLM's (padded) `page_size_bytes`.
    """

    storage: torch.Tensor
    offset: int
    stride: int
    num_blocks: int
    page: int

    @classmethod
    def of(cls, tensor: Any, page_size_bytes: object, name: str = "tensor") -> TensorBytes:
        """The block geometry vLLM's worker uses for `tensor` with pages of this size.

        Raises:
          KVOffloadTypeError: not a torch tensor, or a page size that is not an int.
          GappedLayoutError: vLLM's `view(int8).view(-1, page)` fails for this tensor
            (its worker refuses it too), or the page size is not positive.
        """
        import torch

        check_tensor(tensor, name)
        if isinstance(page_size_bytes, bool) or not isinstance(page_size_bytes, int):
            raise KVOffloadTypeError(
                f"{name}: page_size_bytes must be an int, got {page_size_bytes!r}"
            )
        if page_size_bytes <= 0:
            raise GappedLayoutError(f"{name}: page_size_bytes={page_size_bytes} must be > 0")
        try:
            rows = tensor.detach().view(torch.uint8).view(-1, page_size_bytes)
        except RuntimeError as e:
            raise GappedLayoutError(
                f"{name} (shape {tuple(tensor.shape)}, strides {tuple(tensor.stride())}, "
                f"{tensor.dtype}) cannot be viewed as bytes (-1, {page_size_bytes}), as vLLM's "
                f"worker views it: {e}. Register one [num_blocks, page] view per tensor"
            ) from None
        nbytes = rows.untyped_storage().nbytes()
        whole = torch.empty(0, dtype=torch.uint8, device=rows.device)
        whole.set_(rows.untyped_storage(), 0, (nbytes,), (1,))
        return cls(whole, rows.storage_offset(), rows.stride(0), rows.shape[0], page_size_bytes)

    @property
    def device(self) -> torch.device:
        return self.storage.device

    def check_width(self, width: int, name: str = "tensor") -> None:
        """Raises `GappedLayoutError` unless `width` leading bytes of every block lie in
        the storage and no two blocks share a byte (a load would then write one block's
        bytes into another, in an order nobody defines)."""
        if self.num_blocks == 0 or width == 0:
            return
        end = self.offset + (self.num_blocks - 1) * self.stride + width
        if end > self.storage.numel():
            raise GappedLayoutError(
                f"{name}: {width} bytes from each of {self.num_blocks} rows (byte offset "
                f"{self.offset}, stride {self.stride}) reach byte {end} of a "
                f"{self.storage.numel()}-byte storage; page sizes must fit the allocation"
            )
        if self.num_blocks > 1 and self.stride < width:
            raise GappedLayoutError(
                f"{name}: blocks {self.stride} bytes apart cannot hold {width}-byte pages "
                "without overlapping; a load would write one block into the next"
            )

    def block_view(self, width: int) -> torch.Tensor:
        """uint8 `[num_blocks, width]` over the leading bytes of every block (strided)."""
        return self.storage.as_strided((self.num_blocks, width), (self.stride, 1), self.offset)

    def host_blocks(self, width: int) -> np.ndarray:
        """`block_view` as a read-only numpy array (CPU tensors only; no copy)."""
        flat = self.storage.numpy()
        return np.lib.stride_tricks.as_strided(
            flat[self.offset :], (self.num_blocks, width), (self.stride, 1), writeable=False
        )

    def unit_rows(self, widths: set[int], name: str = "tensor") -> UnitRows:
        """The tensor's blocks as JAX rows, for every width in `widths` (no copy).

        Raises:
          GappedLayoutError: the storage does not start on a 64-byte boundary (XLA would
            copy it), or the blocks lie on so fine a byte grid that the rows outnumber
            32-bit ids.
        """
        stride = self.stride if self.num_blocks > 1 else 0
        unit = math.gcd(self.offset, stride, *widths) or 1
        first = self.storage.data_ptr() + self.offset  # absolute address of block 0
        while first % math.gcd(unit, _ALIGN):  # block 0 must sit a whole number of units
            unit //= 2  # after an aligned address; halving keeps unit a common divisor
        # The import starts `lead` bytes before block 0: aligned, and a whole number of
        # units before it (lead = unit * t with unit * t = first (mod 64)).
        g = math.gcd(unit, _ALIGN)
        t = (first // g) * pow(unit // g, -1, _ALIGN // g) % (_ALIGN // g)
        lead = unit * t
        if lead > self.offset:
            raise GappedLayoutError(
                f"{name}: its storage starts at address {self.storage.data_ptr():#x}, not on "
                f"a {_ALIGN}-byte boundary, so XLA cannot view block 0 without copying; "
                "allocate the KV cache with torch (aligned) instead"
            )
        span = lead + (self.num_blocks - 1) * stride + max(widths)
        rows = span // unit
        if rows > _MAX_ROWS:
            raise GappedLayoutError(
                f"{name}: its blocks lie on a {unit}-byte grid over {span} bytes, "
                f"{rows} rows, more than 32-bit row ids address; align layer offsets and "
                "pages to larger powers of two"
            )
        start = self.offset - lead
        view = self.storage.as_strided((rows, unit), (unit, 1), start)
        return UnitRows(to_jax(view), unit, lead // unit, stride // unit)
