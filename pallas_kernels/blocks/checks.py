"""Trace-time checks of the public API's inputs; each failure raises a typed error."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeGuard, TypeVar, cast

import jax
import numpy as np

from .errors import (
    BlockIdsDtypeError,
    BlockIdsError,
    BlockIdsOutOfRangeError,
    CacheError,
    DuplicateBlockIdsError,
    LayerMismatchError,
    LayoutMismatchError,
    StagingMismatchError,
)
from .layout import KVLayout
from .mesh import staging_sharding

# The caller's ids come back as they were given (a jax or numpy array once checked).
_Ids = TypeVar("_Ids")


def _show(values: np.ndarray, limit: int = 8) -> str:
    head = ", ".join(str(int(v)) for v in values[:limit])
    return f"[{head}{', ...' if values.size > limit else ''}]"


def check_caches(caches: object, layout: KVLayout) -> list[jax.Array]:
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
        raise CacheError(
            "caches must hold at least one array, got an empty sequence; pass [cache] or "
            "the list of a cache group's layers"
        )
    first = caches[0]
    for k, cache in enumerate(caches):
        _check_array(cache, f"caches[{k}]")
        if tuple(cache.shape) != tuple(first.shape) or cache.dtype != first.dtype:
            raise LayerMismatchError(
                f"caches[{k}] is {cache.dtype}{list(cache.shape)} but caches[0] is "
                f"{first.dtype}{list(first.shape)}; every array of one call must share shape "
                "and dtype: call once per group of identical layers"
            )
        devices, first_devices = _devices(cache), _devices(first)
        if devices is not None and first_devices is not None and devices != first_devices:
            raise LayerMismatchError(
                f"caches[{k}] lives on {_show_devices(cache)} but caches[0] on "
                f"{_show_devices(first)}; every array of one call must live on the same "
                "devices: jax.device_put them there first"
            )
    layout.check_cache(tuple(first.shape), first.dtype, name="caches[0]")
    if layout.kv_stacking.name == "SEPARATE" and len(caches) % 2:
        raise LayoutMismatchError(
            f"caches has {len(caches)} arrays; kv_stacking=SEPARATE needs K and V of every "
            "layer, [k0, v0, k1, v1, ...], an even count"
        )
    return list(caches)


def _check_array(x: object, name: str) -> None:
    if not isinstance(x, (jax.Array, np.ndarray)):
        hint = (
            "; to compile without data, trace the call: jax.jit(fn).trace(...)"
            if isinstance(x, jax.ShapeDtypeStruct)
            else "; convert it with jnp.asarray (or jax.dlpack.from_dlpack for a torch tensor)"
        )
        raise TypeError(f"{name} must be a jax.Array or numpy array, got {type(x).__name__}{hint}")
    if _is_concrete(x) and x.is_deleted():
        raise CacheError(
            f"{name} has been deleted: scatter_blocks donates the caches it is given; pass "
            "the arrays the last scatter_blocks returned instead"
        )


def _is_concrete(x: object) -> TypeGuard[jax.Array]:
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def _devices(x: object) -> frozenset[jax.Device] | None:
    return frozenset(x.sharding.device_set) if _is_concrete(x) else None


def _show_devices(x: jax.Array) -> str:
    ids = sorted(d.id for d in x.sharding.device_set)  # type: ignore[attr-defined]
    return f"devices {ids}" if len(ids) > 1 else f"device {ids[0]}"


# Up to this many ids are checked as a Python list: numpy's reductions and np.unique cost
# ~0.3 ms on the first call after an idle pause on the 2-core CI VM (a tenth of a small
# load), a list of a few ints a few microseconds. Errors still come from the numpy path.
_FEW_IDS = 64


def _fine(values: list[int], num_blocks: int, unique: bool) -> bool:
    if values and (min(values) < 0 or max(values) >= num_blocks):
        return False
    return not unique or len(set(values)) == len(values)


def check_block_ids(block_ids: _Ids, num_blocks: int, *, unique: bool) -> _Ids:
    """``block_ids``: int32, 1-D, each in [0, num_blocks); unique when ``unique``.

    Value checks need concrete ids; under an outer ``jax.jit`` the ids are tracers and
    only shape and dtype can be checked here: call this function on the concrete ids
    before entering the jit (the kernels never clamp an id).
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)):
        raise TypeError(
            f"num_blocks must be an int, got {type(num_blocks).__name__} {num_blocks!r}; "
            "pass the caches' block count, e.g. layout.num_blocks(cache.shape)"
        )
    if num_blocks < 0:
        raise BlockIdsError(f"num_blocks must be >= 0, got {num_blocks}; pass the caches' count")
    if not isinstance(unique, bool):
        raise TypeError(f"unique must be a bool, got {type(unique).__name__} {unique!r}")
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
    if ids.size <= _FEW_IDS and _fine(ids.tolist(), num_blocks, unique):
        return block_ids
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


def check_staging(
    staging: object, expected_shape: tuple[int, ...], cache: jax.Array, layout: KVLayout
) -> None:
    """``staging`` has exactly the shape and dtype ``gather_blocks`` returns, and lives
    where the caches do (or is a host array, or uncommitted: jit places those)."""
    dtype = cache.dtype
    if isinstance(staging, jax.ShapeDtypeStruct) or not isinstance(
        staging, (jax.Array, np.ndarray)
    ):
        raise TypeError(
            f"staging must be a jax.Array or numpy array, got {type(staging).__name__}; "
            "pass the array gather_blocks returned for these caches"
        )
    if _is_concrete(staging) and staging.is_deleted():
        raise StagingMismatchError("staging has been deleted (donated); pass a live array")
    if tuple(staging.shape) != tuple(expected_shape):
        raise StagingMismatchError(
            f"staging must have shape [n, num_arrays, *page] = {list(expected_shape)}, got "
            f"{list(staging.shape)}; pass the array gather_blocks returned for these caches"
        )
    if staging.dtype != dtype:
        if np.dtype(staging.dtype).name == np.dtype(dtype).name:  # same name, other byte order
            raise StagingMismatchError(
                f"staging has dtype {np.dtype(staging.dtype).str!r}, the caches "
                f"{np.dtype(dtype).str!r} (another byte order); use "
                "staging.astype(staging.dtype.newbyteorder('='))"
            )
        raise StagingMismatchError(
            f"staging must have the caches' dtype {np.dtype(dtype).name}, got "
            f"{np.dtype(staging.dtype).name}; bitcast it back with "
            f"jax.lax.bitcast_convert_type(staging, {np.dtype(dtype).name!r})"
        )
    if (
        _is_concrete(staging)
        and staging.committed
        and _devices(cache) is not None
        and _devices(staging) != _devices(cache)
    ):
        where = "pk.staging_sharding(caches, layout)"
        if staging_sharding([cache], layout) is None:
            one = len(cast("frozenset[jax.Device]", _devices(cache))) == 1
            where = "the caches' device" if one else "the caches' mesh"
        raise StagingMismatchError(
            f"staging lives on {_show_devices(staging)} but the caches on "
            f"{_show_devices(cache)}; jax.device_put(staging, ...) to {where} first"
        )
