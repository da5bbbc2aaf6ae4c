"""Caches against the config: every property of the arrays that the config states.

The config states the groups and their layers, the KV cache dtype, the tokens of a
block and the bytes one worker keeps per block (`worker_kv_bytes_per_block`: KV heads x
head size x dtype width x block tokens x layers, from the model's KV cache spec). Arrays
that contradict any of them would move, but the tier namespace labels entries with the
config's values, so another engine reading them would take (say) float16 bytes for
bfloat16. `check_caches` refuses them at `KVOffloader(...)` and at `set_caches`, with a
`CacheConfigMismatchError` naming both values and the fix.

Global arrays (sharded over a mesh, or canonical) hold every worker's share of a block,
local arrays one worker's: both are accepted (`_check_block_bytes`). Padded RPA arrays
must have exactly the padded shape of heads and a head size the config's bytes give
(of the model's heads, with `total_kv_heads`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

import pallas_kernels as pk
from jax_kvoffload.config import OffloadingConfig
from jax_kvoffload.config.internals import as_dtype
from jax_kvoffload.errors import KVOffloadValueError
from jax_kvoffload.hostmem.internals import check_index
from jax_kvoffload.offloader._checks import OffloaderError
from jax_kvoffload.transfer import GroupCaches, canonical_group_caches
from jax_kvoffload.transfer.internals import check_distinct


class CacheConfigMismatchError(OffloaderError):
    """Cache arrays that contradict the config (dtype, layers, block tokens, bytes per
    block, KV heads): the message names the config's value, the arrays' and the fix."""


# vLLM's fp8 names stand for a family: e4m3 is float8_e4m3fn on NVIDIA and TPU,
# float8_e4m3fnuz on ROCm (vllm/platforms/rocm.py `fp8_dtype`); exact names are exact.
_FAMILIES = {
    "fp8": ("float8_e4m3fn", "float8_e4m3fnuz"),
    "fp8_e4m3": ("float8_e4m3fn", "float8_e4m3fnuz"),
    "fp8_e5m2": ("float8_e5m2", "float8_e5m2fnuz"),
}

# RPA v3 pads the head size to 128 lanes (pallas_kernels.rpa_cache_shape).
_LANES = 128

_FIX = "or rebuild the config (build_offloading_config) from the model that made these caches"


def check_caches(
    config: OffloadingConfig, caches: Mapping[int, GroupCaches], total_kv_heads: object
) -> dict[int, GroupCaches]:
    """Refuses caches that contradict the config: groups, layers, dtype, block tokens,
    bytes per block, and (canonical pages) every KV head. Returns them, as groups with
    canonical host pages when the config asks for those."""
    if total_kv_heads is not None and check_index("total_kv_heads", total_kv_heads) < 1:
        # 0 divided by zero in the RPA check; a negative count blamed the caches.
        raise OffloaderError(
            f"total_kv_heads={total_kv_heads} must be >= 1: the model's KV heads "
            "(num_key_value_heads of its config), or None"
        )
    groups = {g.group_id: g for g in config.groups}
    unknown = sorted(set(caches) - set(groups))
    missing = sorted(set(groups) - set(caches))
    if unknown or missing:
        raise CacheConfigMismatchError(
            f"caches must cover exactly the offloaded groups {sorted(groups)}; "
            f"unknown {unknown}, missing {missing}"
        )
    for g, gc in caches.items():
        check_group(config, g, gc)
    check_distinct([a for gc in caches.values() for a in gc.arrays], "caches (all groups)")
    out = dict(caches)
    if config.canonical_layout:  # before the bytes: a shard's heads say more than its size
        out = _check_canonical(caches, total_kv_heads)
    heads = None if total_kv_heads is None else check_index("total_kv_heads", total_kv_heads)
    _check_block_bytes(config, out, heads)
    return out


def check_group(config: OffloadingConfig, g: int, gc: GroupCaches) -> None:
    """One group's arrays against the config: layers, dtype, tokens per block."""
    group = next(x for x in config.groups if x.group_id == g)
    _check_layers(g, gc, group.layer_names)
    check_dtype(g, gc.layout, gc.arrays[0].dtype, config.model.dtype)
    _check_tokens(g, gc, group.tokens_per_block, config.parallel.dcp_size)


def _check_layers(g: int, gc: GroupCaches, layers: tuple[str, ...]) -> None:
    per_layer = 2 if gc.layout.kv_stacking is pk.KVStacking.SEPARATE else 1
    if gc.layout.page_format is pk.PageFormat.RAW and len(gc.arrays) % len(layers) == 0:
        return  # raw pages: a layer may keep several state arrays (e.g. Mamba conv + ssm)
    if len(gc.arrays) != per_layer * len(layers):
        how = "K, V per layer (KVStacking.SEPARATE)" if per_layer == 2 else "one per layer"
        raise CacheConfigMismatchError(
            f"group {g}: the config lists {len(layers)} layers {list(layers[:4])}"
            f"{'...' if len(layers) > 4 else ''}, so it needs {per_layer * len(layers)} "
            f"arrays ({how}); got {len(gc.arrays)}: pass the group's arrays, {_FIX}"
        )


def check_dtype(g: int, layout: pk.KVLayout, dtype: object, config_dtype: str) -> None:
    """Arrays of `dtype` in a group of `layout` against the config's KV cache dtype
    (the width alone is not enough: float16 bytes labelled bfloat16 are wrong values)."""
    if layout.page_format is pk.PageFormat.RAW:
        return  # raw pages are words of any encoding
    try:
        want = as_dtype(config_dtype)
    except (TypeError, ValueError):
        return  # a quantized format numpy has no dtype for (nvfp4, ...): nothing to compare
    got = np.dtype(dtype)  # type: ignore[call-overload]
    allowed = _FAMILIES.get(config_dtype, (want.name,))
    if got.name in allowed or (got.kind == "u" and got.itemsize == want.itemsize):
        # Unsigned words of the same width are a bit container of the config's dtype
        # (the demo's uint32 words of float32, vLLM's uint8 fp8 caches): kernels move
        # bits, and a uint container keeps XLA from touching NaN payloads.
        return
    same_width = got.itemsize == want.itemsize
    raise CacheConfigMismatchError(
        f"group {g}: the arrays are {got.name} but the config's KV cache dtype is "
        f"{config_dtype!r} ({want.name})"
        + (
            f", of the same width: the bytes would move but be labelled {want.name} for "
            "every engine that reads them"
            if same_width
            else f" ({got.itemsize} vs {want.itemsize} bytes per element)"
        )
        + f": pass caches of dtype {want.name} (or uint{8 * want.itemsize} words holding its "
        f"bits), or build the config with cache_dtype={got.name!r}"
    )


def _token_axis(layout: pk.KVLayout) -> int | None:
    """Index of the tokens-per-block axis in `layout.page_shape(...)`, None for RAW."""
    stacked = int(layout.kv_stacking in (pk.KVStacking.FIRST, pk.KVStacking.SECOND))
    base = {pk.PageFormat.NHD: 0, pk.PageFormat.HND: 1, pk.PageFormat.MLA: 0}
    base[pk.PageFormat.RPA] = 0
    axis = base.get(layout.page_format)
    return None if axis is None else axis + stacked


def _check_tokens(g: int, gc: GroupCaches, tokens_per_block: int, dcp: int) -> None:
    axis = _token_axis(gc.layout)
    if axis is None:
        return
    page = gc.layout.page_shape(tuple(gc.arrays[0].shape))
    tokens = page[axis]
    # Global arrays hold the whole block; each DCP rank's local array 1/dcp of it.
    allowed = {tokens_per_block} | ({tokens_per_block // dcp} if dcp > 1 else set())
    if tokens not in allowed:
        raise CacheConfigMismatchError(
            f"group {g}: arrays of shape {tuple(gc.arrays[0].shape)} ({gc.layout.describe()}) "
            f"hold {tokens} tokens per block but the config's blocks hold {tokens_per_block}: "
            f"pass the layout that matches the arrays, {_FIX} (its block_size)"
        )


def _check_block_bytes(
    config: OffloadingConfig, caches: Mapping[int, GroupCaches], total_kv_heads: int | None
) -> None:
    """The arrays' bytes per block against `worker_kv_bytes_per_block` (KV heads x head
    size x width x tokens x layers): what catches another head count or head size.

    Local arrays hold one worker's bytes (k = 1); global arrays sharded over the mesh
    hold k workers' shares, 1 <= k <= world_size. RPA arrays are padded (the combined
    head axis to the packing per KV-head shard, the head size to 128 lanes), so their
    size does not state the heads: an RPA group holds the bytes of any (KV heads, head
    size) whose padded shape is exactly the arrays' (`_rpa_kv_bytes`), or its padded
    bytes (a config that counts them). The config states heads x head size only; with
    `total_kv_heads` the heads are the model's (all of them in a global array, or one
    worker's share, `max(1, total // tp)`), so the head size, and with it the padded
    shape, follows from the bytes: exact. Nothing to compare when the config states no
    bytes (vLLM's configs without workers) or a group has raw pages (states of any
    shape, padded to a common page)."""
    per_worker = config.worker_kv_bytes_per_block
    if per_worker <= 0 or any(gc.layout.page_format is pk.PageFormat.RAW for gc in caches.values()):
        return
    workers = max(config.parallel.world_size, 1)
    model_heads = None
    if total_kv_heads is not None:
        model_heads = {total_kv_heads, max(1, total_kv_heads // max(config.parallel.tp_size, 1))}
    totals = {0}
    for gc in caches.values():
        sizes = {gc.block_bytes}
        if gc.layout.page_format is pk.PageFormat.RPA:
            sizes = _rpa_kv_bytes(gc, model_heads)
            if model_heads is None:
                sizes.add(gc.block_bytes)
        totals = {t + b for t in totals for b in sizes}
    if any(t % per_worker == 0 and 1 <= t // per_worker <= workers for t in totals):
        return
    pages = "; ".join(
        f"group {g}: {len(gc.arrays)} x {gc.layout.page_shape(tuple(gc.arrays[0].shape))} "
        f"{np.dtype(gc.arrays[0].dtype).name}"
        for g, gc in sorted(caches.items())
    )
    span = "" if workers == 1 else f" (or k x that for global arrays over k <= {workers} workers)"
    rpa = [
        (g, gc) for g, gc in sorted(caches.items()) if gc.layout.page_format is pk.PageFormat.RPA
    ]
    if rpa:
        got = "; ".join(
            _rpa_shapes(g, gc, per_worker if len(caches) == 1 else 0, model_heads) for g, gc in rpa
        )
        raise CacheConfigMismatchError(
            f"the RPA caches fit no KV heads and head size whose bytes per block are the "
            f"config's worker_kv_bytes_per_block {per_worker}{span}: {got}; pass arrays of "
            f"pallas_kernels.rpa_cache_shape(num_blocks, block_size, num_kv_heads, "
            f"head_size, dtype, shards=...) for the spec's num_kv_heads and head_size, {_FIX}"
        )
    raise CacheConfigMismatchError(
        f"the caches hold {sum(gc.block_bytes for gc in caches.values())} bytes per block "
        f"({pages}) but the config's worker_kv_bytes_per_block is {per_worker}{span}: its "
        f"KV cache spec has other KV heads or another head size than the arrays; pass "
        f"arrays with the spec's num_kv_heads and head_size, {_FIX}"
    )


def _rpa_heads(gc: GroupCaches, only: set[int] | None) -> tuple[int, list[int], list[int]]:
    """(shards, heads, hd64 heads): the KV head counts whose padded rows are the arrays'
    over their KV-head shards, for head sizes of 65+ lanes (K and V in slots of their
    own: `pk.rpa_cache_shape`) and for head size 64 (tpu-inference's kernel_hd64.py: K
    and V of a head share one 128-lane row, `align(H / shards, packing) / packing`
    rows); of those in `only` if given."""
    a = gc.arrays[0]
    rows, packing = int(a.shape[2]), int(a.shape[3])
    shards = pk.rpa_shards(a)
    if rows % shards:
        return shards, [], []
    r = rows // shards  # rows per shard: align(2h, packing) = packing * r
    heads = [shards * h for h in range((packing * (r - 1)) // 2 + 1, packing * r // 2 + 1)]
    hd64 = [shards * h for h in range(packing * (r - 1) + 1, packing * r + 1)]
    if only is not None:
        heads, hd64 = [h for h in heads if h in only], [h for h in hd64 if h in only]
    return shards, heads, hd64


def _rpa_kv_bytes(gc: GroupCaches, only: set[int] | None) -> set[int]:
    """The unpadded KV bytes per block (2 x heads x head size x width x tokens x layers)
    of every (heads, head size) whose padded RPA arrays have exactly this group's shape."""
    a = gc.arrays[0]
    tokens, lanes = int(a.shape[1]), int(a.shape[4])
    per_head = 2 * np.dtype(a.dtype).itemsize * tokens * len(gc.arrays)
    _, heads, hd64 = _rpa_heads(gc, only)
    sizes = range(lanes - _LANES + 1, lanes + 1)  # align(head_size, 128) == lanes
    out = {per_head * h * d for h in heads for d in sizes}
    if lanes == _LANES:
        out |= {per_head * h * 64 for h in hd64}
    return out


def _rpa_shapes(g: int, gc: GroupCaches, per_worker: int, only: set[int] | None) -> str:
    """The group's RPA shape, and the shapes the config's bytes give: for the model's
    heads (`only`: a worker's share first, so the head size is the one the bytes give
    it), else for the heads the arrays' rows could hold."""
    a = gc.arrays[0]
    shape, dt = tuple(int(d) for d in a.shape), np.dtype(a.dtype)
    shards, heads, _ = _rpa_heads(gc, None)
    out = f"group {g}: arrays of shape {shape} ({dt.name}, {shards} KV-head shard(s))"
    out += f" hold {' or '.join(map(str, heads))} KV heads" if heads else " fit no head count"
    if not per_worker:
        return out
    per_head = 2 * dt.itemsize * shape[1] * len(gc.arrays)
    share = None if only is None else min(only)
    wants = []
    for h in sorted(only) if only is not None else heads:
        unit = per_head * (h if share is None else share)
        if per_worker % unit:
            continue
        try:
            want = pk.rpa_cache_shape(shape[0], shape[1], h, per_worker // unit, dt, shards=shards)
        except pk.LayoutError:  # the model's heads do not divide over the arrays' shards
            continue
        wants.append(f"{h} KV heads of head size {per_worker // unit}: {want}")
    who = "the model's" if only is not None else "those"
    return f"{out}; the config's bytes give {who} " + ("; ".join(wants) or "no whole head size")


def _check_canonical(
    caches: Mapping[int, GroupCaches], total_kv_heads: object
) -> dict[int, GroupCaches]:
    if total_kv_heads is None:
        raise OffloaderError(
            "canonical_layout is set: pass total_kv_heads= (the model's KV heads) so the "
            "offloader can check that the caches are global arrays, whose pages are the "
            "canonical pages; or drop 'canonical_layout' from the extra config"
        )
    heads = check_index("total_kv_heads", total_kv_heads)
    out = {}
    for g, gc in caches.items():
        try:
            out[g] = canonical_group_caches(gc, heads)
        except KVOffloadValueError as e:
            raise CacheConfigMismatchError(f"group {g}: {e}") from e
    return out
