"""Trace-time checks of the public API's inputs; each failure raises a typed error."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from .errors import (
    BlockIdsDtypeError,
    BlockIdsError,
    BlockIdsOutOfRangeError,
    DuplicateBlockIdsError,
    LayerMismatchError,
    StagingMismatchError,
)
from .layout import KVLayout


def _show(values: np.ndarray, limit: int = 8) -> str:
    head = ", ".join(str(int(v)) for v in values[:limit])
    return f"[{head}{', ...' if values.size > limit else ''}]"


def check_caches(caches: Any, layout: KVLayout) -> list[jax.Array]:
    """``caches`` is a non-empty sequence of arrays of one shape and dtype, fitting ``layout``."""
    if not isinstance(layout, KVLayout):
        raise TypeError(
            f"layout must be a KVLayout, got {type(layout).__name__}; "
            "use e.g. KVLayout.nhd() or KVLayout.nhd(KVStacking.FIRST)"
        )
    if isinstance(caches, (jax.Array, np.ndarray)) or not isinstance(caches, Sequence):
        raise TypeError(
            f"caches must be a list or tuple of per-layer arrays, got {type(caches).__name__}; "
            "wrap a single array as [cache]"
        )
    if len(caches) == 0:
        raise ValueError("caches must hold at least one array, got an empty sequence")
    first = caches[0]
    for k, cache in enumerate(caches):
        if not hasattr(cache, "shape") or not hasattr(cache, "dtype"):
            raise TypeError(f"caches[{k}] must be an array, got {type(cache).__name__}")
        if tuple(cache.shape) != tuple(first.shape) or cache.dtype != first.dtype:
            raise LayerMismatchError(
                f"caches[{k}] is {cache.dtype}{list(cache.shape)} but caches[0] is "
                f"{first.dtype}{list(first.shape)}; every array of one call must share shape "
                "and dtype: call once per group of identical layers"
            )
    layout.check_cache(tuple(first.shape), first.dtype, name="caches[0]")
    if layout.kv_stacking.name == "SEPARATE" and len(caches) % 2:
        raise ValueError(
            f"caches has {len(caches)} arrays; kv_stacking=SEPARATE needs K and V of every "
            "layer, [k0, v0, k1, v1, ...], an even count"
        )
    return list(caches)


def check_block_ids(block_ids: Any, num_blocks: int, *, unique: bool) -> Any:
    """``block_ids``: int32, 1-D, each in [0, num_blocks); unique when ``unique``.

    Value checks need concrete ids; under an outer ``jax.jit`` the ids are tracers and
    only shape and dtype can be checked here: call this function on the concrete ids
    before entering the jit (the kernels never clamp an id).
    """
    if not isinstance(block_ids, (jax.Array, np.ndarray)):
        raise TypeError(
            f"block_ids must be an int32 array, got {type(block_ids).__name__}; "
            "use np.asarray(ids, dtype=np.int32)"
        )
    if block_ids.dtype != np.int32:
        raise BlockIdsDtypeError(
            f"block_ids must have dtype int32, got {block_ids.dtype}; "
            "use block_ids.astype(np.int32)"
        )
    if block_ids.ndim != 1:
        raise BlockIdsError(
            f"block_ids must be 1-D, got shape {tuple(block_ids.shape)}; use block_ids.reshape(-1)"
        )
    try:
        ids = np.asarray(block_ids)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return block_ids  # traced under an outer jit: values unknown until run time
    bad = ids[(ids < 0) | (ids >= num_blocks)]
    if bad.size:
        raise BlockIdsOutOfRangeError(
            f"block_ids must lie in [0, {num_blocks}) for caches with num_blocks={num_blocks}; "
            f"got {bad.size} out of range: {_show(bad)}; drop them or fix the block table"
        )
    if unique:
        values, counts = np.unique(ids, return_counts=True)
        dups = values[counts > 1]
        if dups.size:
            raise DuplicateBlockIdsError(
                f"block_ids of scatter_blocks must be unique (two writes to one page race); "
                f"got repeated ids {_show(dups)}; keep one staging entry per destination"
            )
    return block_ids


def check_staging(staging: Any, expected_shape: tuple[int, ...], dtype: Any) -> None:
    """``staging`` has exactly the shape and dtype ``gather_blocks`` returns."""
    if not hasattr(staging, "shape") or not hasattr(staging, "dtype"):
        raise TypeError(f"staging must be an array, got {type(staging).__name__}")
    if tuple(staging.shape) != tuple(expected_shape):
        raise StagingMismatchError(
            f"staging must have shape [n, num_arrays, *page] = {list(expected_shape)}, got "
            f"{list(staging.shape)}; pass the array gather_blocks returned for these caches"
        )
    if staging.dtype != dtype:
        raise StagingMismatchError(
            f"staging must have the caches' dtype {np.dtype(dtype).name}, got "
            f"{np.dtype(staging.dtype).name}; bitcast it back with "
            f"jax.lax.bitcast_convert_type(staging, {np.dtype(dtype).name!r})"
        )
