"""Caches sharded over a device mesh: gather and scatter each device's shard where it is.

A global cache sharded along its page axes (KV heads over a TP mesh, say) holds, on every
device, whole blocks of its own heads. Gathering from the global view lets XLA's
partitioner plan the block copy; flattening a page to words then reshards the whole
cache (measured on 2 simulated CPU devices: 383 ms vs 52 ms for one device, and it grows
with the cache, not with the blocks moved). ``local_plan`` recognises the case; the API
then runs the backend per device under ``jax.shard_map``: each device moves its own shard,
nothing crosses devices, and the staging array comes out sharded like the page axes of
the caches (``staging_sharding``), so a device-to-host copy of it moves each shard once.
A cache sharded along the block axis as well (tpu-inference's attention-DP meshes:
blocks over ``attn_dp``, heads over ``model``) also runs per device: each device holds
a range of blocks, takes the global block ids and moves only the ones it owns. A gather
zeroes the rows it does not own and sums the integer words over the block-axis mesh
axes (each row is owned by one device: the sum is that row's bits), so the staging
comes out replicated over those axes and sharded like the page axes; a scatter writes
its own rows and sends the others to one of them with that row's data (or, owning
none, rewrites its first block with the block's own bytes), so no kernel sees an id
outside its shard. XLA's partitioner planned those as collectives over the whole cache
(measured on 4 simulated CPU devices, 2048-block caches: 2x tpu-inference's own
scatter). A cache sharded along an axis before the block axis (the K/V axis of a
FIRST-stacked cache) keeps the global path.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .layout import KVLayout, as_bits
from .layout import as_dtype as _as_dtype

_F = TypeVar("_F", bound=Callable[..., object])
# A shard's index as slice bounds (start, stop, step): the key its replicas share.
_Index = tuple[tuple[int | None, int | None, int | None], ...]


@dataclass(frozen=True)
class LocalPlan:
    """How to run a backend per device: the mesh and the specs of caches and staging.

    ``block_axes``: the mesh axes the block axis is split over (major first; empty when
    every device holds every block). Then the bodies see global block ids and translate
    them with ``owned_ids``, and a gather's rows are combined with ``combine_rows``."""

    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh
    cache_spec: PartitionSpec
    staging_spec: PartitionSpec
    block_axes: tuple[str, ...] = ()

    @functools.cached_property
    def staging_sharding(self) -> NamedSharding:
        """Where the staging of these caches lives (``staging_sharding``)."""
        return NamedSharding(self.mesh, self.staging_spec)

    def owned_ids(self, block_ids: jax.Array, num_local_blocks: int) -> tuple[jax.Array, jax.Array]:
        """Inside ``run``: each id as an index into this device's blocks, and whether
        this device owns it (its shard holds that block)."""
        first = jax.lax.axis_index(self.block_axes) * num_local_blocks
        local = block_ids - first
        return local, (local >= 0) & (local < num_local_blocks)

    def combine_rows(self, staging: jax.Array, owned: jax.Array) -> jax.Array:
        """Inside ``run``: every device's gathered rows -> the rows of their owners, on
        every device of the block axes. On the bits: integer zeros and sums only."""
        bits = as_bits(staging)
        mask = owned.reshape(-1, *(1,) * (bits.ndim - 1))
        bits = jax.lax.psum(jnp.where(mask, bits, jnp.zeros_like(bits)), self.block_axes)
        return _as_dtype(bits, staging.dtype)

    def run(self, body: _F, num_caches: int, with_staging: bool) -> _F:
        """``body(caches, block_ids, zero[, staging])`` mapped over the mesh (``zero``: the
        replicated run-time 0 of ``layout.fenced``)."""
        caches = tuple(self.cache_spec for _ in range(num_caches))
        in_specs: tuple[tuple[PartitionSpec, ...] | PartitionSpec, ...]
        in_specs = (caches, PartitionSpec(), PartitionSpec())
        in_specs += (self.staging_spec,) if with_staging else ()
        out_specs = caches if with_staging else self.staging_spec
        return jax.shard_map(
            body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )


def local_plan(caches: Sequence[jax.Array], layout: KVLayout) -> LocalPlan | None:
    """A ``LocalPlan`` when every cache has one ``NamedSharding`` over several devices
    that shards the block axis or axes after it (and is not fully replicated); else None.

    Axes before the block axis (the K/V axis of a ``FIRST``-stacked cache) stay whole:
    the word views reshape them with their global size."""
    shardings = [getattr(c, "sharding", None) for c in caches]
    first = shardings[0]
    if not isinstance(first, NamedSharding) or len(first.device_set) == 1:
        return None
    if any(s != first for s in shardings[1:]):
        return None
    return _plan(first, tuple(caches[0].shape), layout)


@functools.lru_cache(maxsize=256)
def _plan(first: NamedSharding, shape: tuple[int, ...], layout: KVLayout) -> LocalPlan | None:
    """``local_plan`` for caches of one sharding and shape, made once: the same plan
    object every call, which the kernels' jit (a static argument) then finds by identity
    instead of hashing and comparing a new one (measured: ~30 us of a 0.3 ms scatter)."""
    ndim = len(shape)
    spec = tuple(first.spec) + (None,) * (ndim - len(first.spec))
    # Mesh axes of one device split nothing (``P("data", None, "model")`` with a data
    # axis of size 1, as tpu-inference shards its caches): read them as unsharded.
    spec = tuple(_without_trivial(p, first.mesh) for p in spec)
    axis = layout.block_axis
    if any(p is not None for p in spec[:axis]) or all(p is None for p in spec):
        return None
    entry = spec[axis]
    blocks = () if entry is None else tuple(entry if isinstance(entry, tuple) else (entry,))
    if blocks and shape[axis] % math.prod(first.mesh.shape[n] for n in blocks):
        return None  # uneven block shards: the global path
    page = tuple(p for i, p in enumerate(spec) if i != axis)
    return LocalPlan(first.mesh, PartitionSpec(*spec), PartitionSpec(None, None, *page), blocks)


def _without_trivial(entry: Any, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> Any:
    # `entry`: a PartitionSpec entry (an axis name, a tuple of them, None or
    # UNCONSTRAINED), which jax leaves untyped.
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return entry
    names = entry if isinstance(entry, tuple) else (entry,)
    kept = tuple(n for n in names if mesh.shape[n] > 1)
    if not kept:
        return None
    return kept if isinstance(entry, tuple) else kept[0]


def staging_sharding(caches: Sequence[jax.Array], layout: KVLayout) -> NamedSharding | None:
    """Where ``gather_blocks`` puts its staging for these caches (and where
    ``scatter_blocks`` wants it): sharded like the caches' page axes, or None when the
    caches take the global path."""
    from .checks import check_caches  # checks imports this module

    plan = local_plan(check_caches(caches, layout), layout)
    return None if plan is None else plan.staging_sharding


def run_time_zero(caches: Sequence[jax.Array], zero: np.ndarray) -> jax.Array | np.ndarray:
    """``zero`` (the kernels' run-time 0, ``layout.fenced``) already on every device of
    concrete caches, replicated; else ``zero`` as it is. A numpy argument is copied to
    every device at every call (measured: ~50 us of a 0.3 ms scatter on 4 CPU devices)."""
    sharding = getattr(caches[0], "sharding", None)
    # Uncommitted caches keep the numpy zero: a committed one would commit the results
    # (the staging, the scattered caches), which jax then no longer moves to meet
    # arrays on another device.
    if (
        isinstance(caches[0], jax.core.Tracer)
        or not getattr(caches[0], "committed", True)
        or not isinstance(sharding, (NamedSharding, jax.sharding.SingleDeviceSharding))
    ):
        return zero
    placed = _zero_on(sharding, int(zero))
    # A cached zero deleted by its owner's sweep (``for a in jax.live_arrays():
    # a.delete()``, a common way to free a device) would fail every later call.
    if placed.is_deleted():
        _zero_on.cache_clear()
        placed = _zero_on(sharding, int(zero))
    return placed


@functools.lru_cache(maxsize=64)
def _zero_on(sharding: jax.sharding.Sharding, value: int) -> jax.Array:
    where = sharding
    if isinstance(sharding, NamedSharding):  # replicated over the caches' mesh
        where = NamedSharding(sharding.mesh, PartitionSpec(), memory_kind=sharding.memory_kind)
    with jax.ensure_compile_time_eval():  # a concrete array, even under an outer trace
        placed: jax.Array = jax.device_put(np.uint32(value), where)
    return placed


def spans_devices(caches: Sequence[jax.Array]) -> bool:
    """Some concrete cache lives on more than one device (tracers: unknown, False)."""
    return any(
        isinstance(c, jax.Array)
        and not isinstance(c, jax.core.Tracer)
        and len(c.sharding.device_set) > 1
        for c in caches
    )


# The TPU and Mosaic GPU interpreters simulate every device of a computation and
# synchronise them through shared host state: on several CPU devices they deadlock
# (TPU interpreter, 8 devices, 160 KiB shards, even for a bare pallas_call) or fail a
# barrier check and hang (Mosaic GPU, 4 devices) inside jax (issue 12). Interpret mode
# is for tests, so caches spread over devices run one device's worth at a time, on one
# device: each distinct shard of a page-sharded cache in turn (the same kernel the
# shard_map path runs per device), or, for any other sharding (blocks split over devices
# among them), the whole cache.


def _home(caches: Sequence[jax.Array]) -> jax.Device:
    return min(caches[0].sharding.device_set, key=lambda d: d.id)  # type: ignore[attr-defined]


def _shards(cache: jax.Array) -> dict[_Index, list[jax.Shard]]:
    """This process's shards of ``cache`` grouped by index (replicas share one), keyed
    by the index's slice bounds."""
    groups: dict[_Index, list[jax.Shard]] = {}
    for shard in cache.addressable_shards:
        groups.setdefault(tuple((s.start, s.stop, s.step) for s in shard.index), []).append(shard)
    return groups


def gather_one_device_at_a_time(
    caches: Sequence[jax.Array], layout: KVLayout, run: Callable[[list[jax.Array]], jax.Array]
) -> jax.Array:
    """``run(single_device_caches) -> staging`` over each shard in turn (see above)."""
    home = _home(caches)
    plan = local_plan(caches, layout)
    if plan is None or plan.block_axes:
        staging: jax.Array = run([jax.device_put(c, home) for c in caches])
        if plan is not None:  # blocks split: where the per-device path puts it
            staging = jax.device_put(staging, plan.staging_sharding)
        return staging
    per_cache = [_shards(c) for c in caches]
    pieces = []
    for key, shards in per_cache[0].items():
        staged = run([jax.device_put(groups[key][0].data, home) for groups in per_cache])
        pieces += [jax.device_put(staged, s.device) for s in shards]
    shape = (pieces[0].shape[0], len(caches), *layout.page_shape(tuple(caches[0].shape)))
    return jax.make_array_from_single_device_arrays(shape, plan.staging_sharding, pieces)


def scatter_one_device_at_a_time(
    caches: Sequence[jax.Array],
    staging: jax.Array | np.ndarray,
    layout: KVLayout,
    run: Callable[[list[jax.Array], jax.Array], Sequence[jax.Array]],
) -> list[jax.Array]:
    """``run(single_device_caches, staging) -> caches`` over each shard in turn; every
    result keeps its cache's sharding."""
    home = _home(caches)
    plan = local_plan(caches, layout)
    if plan is None or plan.block_axes:
        out = run([jax.device_put(c, home) for c in caches], jax.device_put(staging, home))
        return [jax.device_put(o, c.sharding) for o, c in zip(out, caches, strict=True)]
    per_cache = [_shards(c) for c in caches]
    pieces: list[list[jax.Array]] = [[] for _ in caches]
    axis = layout.block_axis
    # Sliced as integers: an eager slice of a float array is an XLA:CPU copy that runs
    # through f32 (fp8/bf16 NaN payloads quieted, issue 21); ``run`` takes the bits.
    bits = as_bits(jnp.asarray(staging))  # a host staging: its bytes, copied as they are
    for key, shards in per_cache[0].items():
        index = tuple(slice(*bounds) for bounds in key)
        page = (slice(None), slice(None), *index[:axis], *index[axis + 1 :])
        local = run(
            [jax.device_put(groups[key][0].data, home) for groups in per_cache],
            jax.device_put(bits[page], home),
        )
        for layer, o in enumerate(local):
            pieces[layer] += [jax.device_put(o, s.device) for s in shards]
    return [
        jax.make_array_from_single_device_arrays(c.shape, c.sharding, p)
        for c, p in zip(caches, pieces, strict=True)
    ]
