"""Guarded imports of the optional Pallas backends, and the one private jax name we use.

jax ships the TPU, Triton and Mosaic GPU Pallas front ends as separate submodules whose
names drift between releases (0.10.2 .. 0.11.x). A missing one must not break
``import pallas_kernels``: it only makes its backend unavailable, with the reason kept
for the error message.

Private jax API in use (only here): ``InterpretGPUParams``, the Mosaic GPU interpreter's
params class, which jax 0.10.2 defines in ``jax._src.pallas.mosaic_gpu.interpret.params``
without exporting it; the public ``jax.experimental.pallas.mosaic_gpu`` name is tried
first. Without it only ``backend="mosaic_gpu", interpret=True`` is unavailable.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

__all__ = [
    "MOSAIC_GPU_IMPORT_ERROR",
    "TPU_IMPORT_ERROR",
    "TRITON_IMPORT_ERROR",
    "gpu_interpret_params",
    "gpu_interpret_params_type",
    "plgpu",
    "pltpu",
    "pltriton",
    "tpu_interpret_params",
]


def _try_import(name: str) -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module(name), ""
    except Exception as exc:  # any import-time failure means "backend unavailable"
        return None, f"{type(exc).__name__}: {exc}"


if TYPE_CHECKING:  # typed as the modules: a backend uses its module only where it imported
    import jax.experimental.pallas.mosaic_gpu as plgpu
    import jax.experimental.pallas.tpu as pltpu
    import jax.experimental.pallas.triton as pltriton

    TPU_IMPORT_ERROR: str
    TRITON_IMPORT_ERROR: str
    MOSAIC_GPU_IMPORT_ERROR: str
else:
    pltpu, TPU_IMPORT_ERROR = _try_import("jax.experimental.pallas.tpu")
    pltriton, TRITON_IMPORT_ERROR = _try_import("jax.experimental.pallas.triton")
    plgpu, MOSAIC_GPU_IMPORT_ERROR = _try_import("jax.experimental.pallas.mosaic_gpu")


def gpu_interpret_params_type() -> type | None:
    """The Mosaic GPU interpreter's params class, or None where jax lacks one."""
    cls = getattr(plgpu, "InterpretGPUParams", None) if plgpu is not None else None
    if cls is None:
        mod, _ = _try_import("jax._src.pallas.mosaic_gpu.interpret.params")
        cls = getattr(mod, "InterpretGPUParams", None) if mod is not None else None
    return cls


def gpu_interpret_params() -> object | None:
    """The Mosaic GPU interpreter's default params, or None where jax lacks one."""
    cls = gpu_interpret_params_type()
    return cls() if cls is not None else None


def tpu_interpret_params() -> object | None:
    """The TPU interpreter's params (HBM/VMEM/SMEM, DMA and semaphore simulation)."""
    cls = getattr(pltpu, "InterpretParams", None) if pltpu is not None else None
    return cls() if cls is not None else None
