"""Caches sharded over a device mesh: gather and scatter each device's shard where it is.

A global cache sharded along its page axes (KV heads over a TP mesh, say) holds, on every
device, whole blocks of its own heads. Gathering from the global view lets XLA's
partitioner plan the block copy; flattening a page to words then reshards the whole
cache (measured on 2 simulated CPU devices: 383 ms vs 52 ms for one device, and it grows
with the cache, not with the blocks moved). ``local_plan`` recognises the case; the API
then runs the backend per device under ``jax.shard_map``: each device moves its own shard,
nothing crosses devices, and the staging array comes out sharded like the page axes of
the caches (``staging_sharding``), so a device-to-host copy of it moves each shard once.
A cache sharded along the block axis, or along an axis before it (the K/V axis of a
FIRST-stacked cache), keeps the global path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .layout import KVLayout


@dataclass(frozen=True)
class LocalPlan:
    """How to run a backend per device: the mesh and the specs of caches and staging."""

    mesh: Any
    cache_spec: PartitionSpec
    staging_spec: PartitionSpec

    def run(self, body: Any, num_caches: int, with_staging: bool) -> Any:
        """``body(caches, block_ids[, staging])`` mapped over the mesh."""
        caches = tuple(self.cache_spec for _ in range(num_caches))
        in_specs = (caches, PartitionSpec()) + ((self.staging_spec,) if with_staging else ())
        out_specs = caches if with_staging else self.staging_spec
        return jax.shard_map(
            body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )


def local_plan(caches: Sequence[Any], layout: KVLayout) -> LocalPlan | None:
    """A ``LocalPlan`` when every cache has one ``NamedSharding`` over several devices
    that shards only axes after the block axis (and is not fully replicated); else None.

    Axes before the block axis (the K/V axis of a ``FIRST``-stacked cache) stay whole:
    the word views reshape them with their global size."""
    shardings = [getattr(c, "sharding", None) for c in caches]
    first = shardings[0]
    if not isinstance(first, NamedSharding) or len(first.device_set) == 1:
        return None
    if any(s != first for s in shardings[1:]):
        return None
    ndim = caches[0].ndim
    spec = tuple(first.spec) + (None,) * (ndim - len(first.spec))
    axis = layout.block_axis
    if any(p is not None for p in spec[: axis + 1]) or all(p is None for p in spec):
        return None
    page = tuple(p for i, p in enumerate(spec) if i != layout.block_axis)
    return LocalPlan(first.mesh, PartitionSpec(*spec), PartitionSpec(None, None, *page))


def staging_sharding(caches: Sequence[Any], layout: KVLayout) -> NamedSharding | None:
    """Where ``gather_blocks`` puts its staging for these caches (and where
    ``scatter_blocks`` wants it): sharded like the caches' page axes, or None when the
    caches take the global path."""
    plan = local_plan(caches, layout)
    return None if plan is None else NamedSharding(plan.mesh, plan.staging_spec)
