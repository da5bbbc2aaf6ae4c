"""Torch bridge: zero-copy DLPack views of torch KV tensors, and a torch KV worker.

Importing this module does not import torch (the functions do, on first call).

- `to_jax(tensor)` / `to_torch(array)`: zero-copy views for every KV dtype; tensors with
  gapped strides or unaligned data are refused with `GappedLayoutError` (XLA would copy
  them), 64-bit tensors without `jax_enable_x64` with `NarrowingDTypeError`, tensors on
  a device DLPack cannot export (meta, ...) or of a sub-byte dtype (torch.uint4) with
  `UnsupportedTensorError`.
- `raw_pages(tensor, block_axis)`: the whole backing allocation as `[rows, page_bytes]`
  bytes plus the rows of every block, for per-layer views with gaps.
- `TorchKVWorker`: moves blocks between torch KV tensors and host chunks with vLLM's
  job semantics (`group_sizes`, `block_indices`, mid-chunk starts) and byte contract
  (each ref's unpadded page, at any byte offset of the tensor's storage).
"""

from jax_kvoffload.bridge._job_plan import JobSpecError as JobSpecError
from jax_kvoffload.bridge._job_plan import JobSpecTypeError as JobSpecTypeError
from jax_kvoffload.bridge._job_plan import TensorMove as TensorMove
from jax_kvoffload.bridge._job_plan import plan_job as plan_job
from jax_kvoffload.bridge._torch import GappedLayoutError as GappedLayoutError
from jax_kvoffload.bridge._torch import NarrowingDTypeError as NarrowingDTypeError
from jax_kvoffload.bridge._torch import RawPages as RawPages
from jax_kvoffload.bridge._torch import UnsupportedTensorError as UnsupportedTensorError
from jax_kvoffload.bridge._torch import raw_pages as raw_pages
from jax_kvoffload.bridge._torch import to_jax as to_jax
from jax_kvoffload.bridge._torch import to_torch as to_torch
from jax_kvoffload.bridge._torch_worker import Finished as Finished
from jax_kvoffload.bridge._torch_worker import TorchKVWorker as TorchKVWorker
from jax_kvoffload.bridge._torch_worker import WorkerClosedError as WorkerClosedError

__all__ = [
    "Finished",
    "GappedLayoutError",
    "JobSpecError",
    "JobSpecTypeError",
    "NarrowingDTypeError",
    "RawPages",
    "TensorMove",
    "TorchKVWorker",
    "UnsupportedTensorError",
    "WorkerClosedError",
    "plan_job",
    "raw_pages",
    "to_jax",
    "to_torch",
]
