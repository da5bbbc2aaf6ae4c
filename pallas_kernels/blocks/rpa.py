"""The ragged-paged-attention (RPA) v3 cache: its geometry, and its canonical pages.

tpu-inference, sglang-jax and EasyDeL keep one array per attention layer,
``[num_blocks, block_size, kv_rows, packing, head_dim_padded]`` with
``packing = 32 // dtype bits`` (bf16 2, fp8/int8 4, fp32 1). K and V alternate in the
*slots* of the combined head axis: slot ``2h`` is K of head h, ``2h + 1`` its V, and slot
``s`` sits at row ``s // packing``, position ``s % packing``. The arrays are sharded over
the KV-head mesh axes on axis 2: an engine on ``S`` shards computes the shape of one
shard and multiplies it back, so each shard holds ``align(2H / S, packing)`` slots of
which the first ``2H / S`` are real, the rest zero padding; head_dim is zero-padded to
128 lanes. The global array therefore depends on ``S`` when ``2H / S`` is not a
multiple of the packing (fp8 with 4 heads on 4 shards: 4 rows, half of them padding).

The *canonical* page drops that padding: ``[block_size, 2H, head_dim_padded]``, the real
slots in order, the same bytes whichever mesh wrote them (and exactly the bytes of the
RPA page whenever no shard pads). ``rpa_canonical`` makes it from a staging array the
gather returned; ``rpa_merge_canonical`` writes it back into the real slots of one,
leaving every padding slot's bytes as they were. Both move integer words only.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from .errors import LayoutError, LayoutMismatchError
from .layout import RPA_LANES, as_bits, check_rpa_dtype


def _align(x: int, m: int) -> int:
    return -(-x // m) * m


def rpa_packing(dtype: npt.DTypeLike) -> int:
    """Slots per 32-bit word for ``dtype``: ``32 // bits`` (bf16 2, fp8/int8 4, fp32 1)."""
    check_rpa_dtype(dtype)
    itemsize: int = np.dtype(dtype).itemsize
    if itemsize not in (1, 2, 4):
        raise LayoutError(
            f"dtype {np.dtype(dtype).name} has {itemsize} bytes; the RPA layout packs 1-, 2- "
            "or 4-byte elements into 32-bit words"
        )
    return 4 // itemsize


def _check_positive(**values: object) -> None:
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise LayoutError(f"{key} must be an int >= 1, got {value!r}")


def rpa_slots_per_shard(
    num_kv_heads: int, dtype: npt.DTypeLike, shards: int = 1
) -> tuple[int, int]:
    """``(real, padded)`` slots each of ``shards`` KV-head shards holds."""
    _check_positive(num_kv_heads=num_kv_heads, shards=shards)
    if num_kv_heads % shards:
        raise LayoutError(
            f"num_kv_heads={num_kv_heads} does not divide over shards={shards}: an RPA shard "
            "holds whole heads (K and V slots of each); use a KV-head mesh axis whose size "
            f"divides {num_kv_heads}"
        )
    real = 2 * num_kv_heads // shards
    return real, _align(real, rpa_packing(dtype))


def rpa_cache_shape(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: npt.DTypeLike,
    *,
    shards: int = 1,
) -> tuple[int, int, int, int, int]:
    """The global RPA v3 array of an engine whose KV heads are split over ``shards``
    devices (tpu-inference's ``get_kv_cache_shape`` per shard, times ``shards``)."""
    _check_positive(num_blocks=num_blocks, block_size=block_size, head_dim=head_dim)
    packing = rpa_packing(dtype)
    _, padded = rpa_slots_per_shard(num_kv_heads, dtype, shards)
    rows = shards * padded // packing
    return (num_blocks, block_size, rows, packing, _align(head_dim, RPA_LANES))


def rpa_shards(cache: jax.Array | np.ndarray) -> int:
    """How many distinct shards split ``cache`` along axis 2 (1 for host arrays)."""
    sharding = getattr(cache, "sharding", None)
    if sharding is None:
        return 1
    local = sharding.shard_shape(tuple(cache.shape))
    return int(cache.shape[2] // local[2])


def check_rpa_geometry(
    shape: tuple[int, ...], dtype: npt.DTypeLike, num_kv_heads: int, shards: int
) -> None:
    """Raises ``LayoutMismatchError`` unless an RPA array of ``shape`` holds
    ``num_kv_heads`` heads over ``shards`` shards, in the formula's rows."""
    want = rpa_cache_shape(1, 1, num_kv_heads, 1, dtype, shards=shards)
    if tuple(shape[2:4]) != want[2:4]:
        raise LayoutMismatchError(
            f"an RPA array of shape {tuple(shape)} ({np.dtype(dtype).name}) sharded over "
            f"{shards} KV-head shard(s) should have (kv_rows, packing) = {want[2:4]} for "
            f"{num_kv_heads} KV heads, got {tuple(shape[2:4])}: pass the model's KV heads; "
            "head_dim-64 caches (K and V of a head in one 128-lane row) are not this layout"
        )


def _page_axes(x: jax.Array) -> tuple[tuple[int, ...], int, int]:
    lead = tuple(x.shape[:-4])
    return lead, x.shape[-4], x.shape[-1]


def rpa_canonical(staging: jax.Array, num_kv_heads: int, shards: int) -> jax.Array:
    """``[..., block_size, kv_rows, packing, D]`` RPA pages (e.g. a gather's staging) as
    canonical pages ``[..., block_size, 2H, D]``: every shard's real slots in order, its
    padding slots dropped. Moves same-width integers only (the result has ``staging``'s
    dtype, bitcast back last), so every bit pattern survives."""
    check_rpa_geometry((0, *staging.shape[-4:]), staging.dtype, num_kv_heads, shards)
    real, padded = rpa_slots_per_shard(num_kv_heads, staging.dtype, shards)
    lead, bs, d = _page_axes(staging)
    bits = as_bits(staging).reshape(*lead, bs, shards, padded, d)
    if padded != real:
        bits = bits[..., :real, :]
    out = bits.reshape(*lead, bs, shards * real, d)
    return jax.lax.bitcast_convert_type(out, staging.dtype) if out.dtype != staging.dtype else out


def rpa_merge_canonical(
    into: jax.Array, canonical: jax.Array, num_kv_heads: int, shards: int
) -> jax.Array:
    """``into`` (RPA pages, e.g. the gather of the blocks about to be loaded) with its real
    slots replaced by ``canonical`` (``rpa_canonical``'s shape); padding slots keep their
    bytes. Where no shard pads this is ``canonical`` reshaped (``into`` unread)."""
    check_rpa_geometry((0, *into.shape[-4:]), into.dtype, num_kv_heads, shards)
    real, padded = rpa_slots_per_shard(num_kv_heads, into.dtype, shards)
    lead, bs, d = _page_axes(into)
    want = (*lead, bs, shards * real, d)
    if tuple(canonical.shape) != want or canonical.dtype != into.dtype:
        raise LayoutMismatchError(
            f"canonical pages must be {into.dtype}{list(want)} for these RPA pages, got "
            f"{canonical.dtype}{list(canonical.shape)}; pass rpa_canonical's output"
        )
    src = as_bits(canonical).reshape(*lead, bs, shards, real, d)
    if padded == real:
        out = src.reshape(into.shape)
    else:
        dst = as_bits(into).reshape(*lead, bs, shards, padded, d)
        out = jnp.concatenate([src, dst[..., real:, :]], axis=-2).reshape(into.shape)
    return jax.lax.bitcast_convert_type(out, into.dtype) if out.dtype != into.dtype else out


def rpa_needs_merge(num_kv_heads: int, dtype: npt.DTypeLike, shards: int) -> bool:
    """Whether a shard of this geometry pads (a load must then keep the padding)."""
    real, padded = rpa_slots_per_shard(num_kv_heads, dtype, shards)
    return real != padded


def rpa_pack(
    k: npt.ArrayLike,
    v: npt.ArrayLike,
    *,
    shards: int = 1,
    pad_value: Callable[[tuple[int, ...]], npt.ArrayLike] | None = None,
) -> np.ndarray:
    """K and V ``[num_blocks, block_size, H, head_dim]`` (numpy) as one RPA array for
    ``shards`` KV-head shards (tpu-inference's ``merge_kv``): padding zero, or
    ``pad_value`` (a function of a shape returning bits, for tests)."""
    k, v = np.asarray(k), np.asarray(v)
    if k.ndim != 4 or k.shape != v.shape or k.dtype != v.dtype:
        raise LayoutMismatchError(
            f"rpa_pack needs K and V of one shape [num_blocks, block_size, H, head_dim] and "
            f"one dtype, got K {k.dtype}{list(k.shape)} and V {v.dtype}{list(v.shape)}"
        )
    nb, bs, h, hd = k.shape
    shape = rpa_cache_shape(nb, bs, h, hd, k.dtype, shards=shards)
    real, padded = rpa_slots_per_shard(h, k.dtype, shards)
    bits = np.dtype(f"u{k.dtype.itemsize}")
    out = np.zeros((nb, bs, shards, padded, shape[4]), bits)
    if pad_value is not None:
        out[...] = pad_value(out.shape)
    slots = np.stack([k.view(bits), v.view(bits)], axis=3).reshape(nb, bs, shards, real, hd)
    out[..., :real, :hd] = slots
    return out.reshape(shape).view(k.dtype)


def rpa_unpack(
    cache: npt.ArrayLike, num_kv_heads: int, head_dim: int, *, shards: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of ``rpa_pack``: numpy K, V ``[num_blocks, block_size, H, head_dim]``."""
    cache = np.asarray(cache)
    if cache.ndim != 5:
        raise LayoutMismatchError(
            f"rpa_unpack needs an RPA array [num_blocks, block_size, kv_rows, packing, D], "
            f"got shape {tuple(cache.shape)}"
        )
    check_rpa_geometry(cache.shape, cache.dtype, num_kv_heads, shards)
    _check_positive(head_dim=head_dim)
    if head_dim > cache.shape[4]:
        raise LayoutMismatchError(
            f"head_dim={head_dim} is wider than the array's {cache.shape[4]} lanes "
            f"(shape {tuple(cache.shape)}); pass the model's head_dim"
        )
    real, padded = rpa_slots_per_shard(num_kv_heads, cache.dtype, shards)
    nb, bs = cache.shape[:2]
    slots = cache.reshape(nb, bs, shards, padded, -1)[..., :real, :head_dim]
    kv = slots.reshape(nb, bs, num_kv_heads, 2, head_dim)
    return kv[..., 0, :], kv[..., 1, :]
