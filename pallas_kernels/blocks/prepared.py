"""``ScatterPlan``: ``scatter_blocks`` for caches of one geometry, checked and resolved once.

A serving engine scatters into the same caches step after step. ``scatter_blocks``
checks every argument and picks the backend, the per-device plan and the shardings at
every call: on a 2-core host that Python costs 0.06 ms hot and ~0.6 ms on the first call
after an idle pause (the host's caches gone cold), a third of a small load. A plan does
that work once (``plan_scatter``); a call then checks what can change cheaply (the
caches' geometry, the staging's shape and dtype), and takes block ids already on the
devices (``ids_sharding``), so that a loader can put them there together with its
staging, in one ``jax.device_put``, instead of having the kernel's jit place a numpy
array (~0.35 ms more after a pause, measured on 4 simulated CPU devices).

Ids on the devices are not read back to be checked (that would be a device-to-host
copy per call): they must be unique and in range, as for ids traced under an outer
``jax.jit``. Numpy ids are checked as ``scatter_blocks`` checks them.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .api import ScatterRoute, dispatch_scatter, scatter_route
from .checks import check_block_ids, check_caches, check_staging
from .errors import BlockIdsError, CacheError, LayerMismatchError
from .layout import KVLayout

__all__ = ["ScatterPlan", "plan_scatter"]


class ScatterPlan:
    """``scatter_blocks(caches, block_ids, staging, ...)`` for caches of the geometry it
    was planned for (``plan_scatter``): their count, shape, dtype and sharding.

    Attributes:
      layout: the caches' ``KVLayout``.
      ids_sharding: where block ids may be placed ahead of a call (a replicated
        sharding over the caches' devices), or None when the plan takes numpy ids only
        (uncommitted caches, and interpreters that run one device at a time).
      staging_sharding: where the staging goes (``staging_sharding(caches, layout)``):
        sharded like the caches' page axes, or None on the global path.
    """

    __slots__ = (
        "_geometry",
        "_num_blocks",
        "_page",
        "_route",
        "ids_sharding",
        "layout",
        "staging_sharding",
    )

    def __init__(self, caches: Sequence[jax.Array], layout: KVLayout, route: ScatterRoute) -> None:
        first = caches[0]
        self.layout = layout
        self._route = route
        self._geometry = _geometry(caches)
        self._num_blocks = layout.num_blocks(tuple(first.shape))
        self._page = (len(caches), *layout.page_shape(tuple(first.shape)))
        self.ids_sharding = None if route.one_device_at_a_time else _ids_sharding(first)
        self.staging_sharding = None if route.local is None else route.local.staging_sharding

    def matches(self, caches: Sequence[jax.Array]) -> bool:
        """Whether ``caches`` have the geometry this plan was made for."""
        return _geometry(caches) == self._geometry

    def __call__(
        self,
        caches: Sequence[jax.Array],
        block_ids: jax.Array | np.ndarray,
        staging: jax.Array | np.ndarray,
    ) -> list[jax.Array]:
        """Writes ``staging[i]`` into page ``block_ids[i]`` of every array, in place (the
        caches are donated, as by ``scatter_blocks``); returns the updated caches.

        ``block_ids``: int32 ``[n]``; numpy ids are checked (unique, in range), ids on
        the devices must be placed at ``ids_sharding`` and are trusted (module doc).
        ``staging``: ``[n, len(caches), *page_shape]`` in the caches' dtype.
        Raises ``LayerMismatchError`` for caches of another geometry (plan again)."""
        if not isinstance(caches, (list, tuple)):
            caches = tuple(caches)
        if not self.matches(caches):
            raise LayerMismatchError(
                f"caches are {_show(_geometry(caches))} but this ScatterPlan was made for "
                f"{_show(self._geometry)}; make a plan for them with plan_scatter"
            )
        for i, c in enumerate(caches):
            # jax's own error here is a bare RuntimeError, raised at dispatch.
            if isinstance(c, jax.Array) and c.is_deleted():
                raise CacheError(
                    f"caches[{i}] has been deleted: a ScatterPlan donates the caches it is "
                    "given; pass the arrays the last call returned instead"
                )
        if isinstance(block_ids, np.ndarray):
            check_block_ids(block_ids, self._num_blocks, unique=True)
        elif (
            not isinstance(block_ids, jax.Array)
            or block_ids.dtype != np.int32
            or (block_ids.ndim != 1)
        ):
            raise BlockIdsError(
                "block_ids must be an int32 [n] numpy array, or one placed at "
                f"ids_sharding, got {type(block_ids).__name__} "
                f"{getattr(block_ids, 'dtype', '')}{list(getattr(block_ids, 'shape', ()))}"
            )
        elif self.ids_sharding is None:
            raise BlockIdsError(
                "this ScatterPlan takes numpy block ids only (ids_sharding is None: "
                "uncommitted caches, or an interpreter that runs one device at a time)"
            )
        elif block_ids.committed and block_ids.sharding != self.ids_sharding:
            # Elsewhere (another device, the same devices in another mesh order, split
            # over the mesh): jax would raise a bare ValueError, or move them per call.
            raise BlockIdsError(
                f"block_ids live at {block_ids.sharding} but this ScatterPlan takes device "
                f"ids at its ids_sharding {self.ids_sharding}; "
                "jax.device_put(block_ids, plan.ids_sharding), or pass numpy ids"
            )
        n = block_ids.shape[0]
        check_staging(staging, (n, *self._page), caches[0], self.layout)
        if n == 0:
            return list(caches)
        return dispatch_scatter(self._route, caches, block_ids, staging)


def plan_scatter(
    caches: Sequence[jax.Array],
    *,
    layout: KVLayout,
    backend: str = "auto",
    config: object = None,
    interpret: object = False,
) -> ScatterPlan:
    """A ``ScatterPlan`` for caches like ``caches`` (checked as ``scatter_blocks`` checks
    them; the same typed errors). Arguments as for ``scatter_blocks``."""
    checked = check_caches(caches, layout)
    if any(isinstance(c, jax.core.Tracer) for c in checked):
        raise TypeError(
            "plan_scatter needs concrete caches (a plan outlives a trace); inside jax.jit "
            "call scatter_blocks"
        )
    return ScatterPlan(checked, layout, scatter_route(checked, layout, backend, config, interpret))


# One array's part of a plan's geometry: its shape, dtype and sharding.
_Array = tuple[tuple[int, ...], object, object]
# What a plan depends on: every array's part, and whether the first is committed.
_Geometry = tuple[tuple[_Array, ...], bool]


def _geometry(caches: Sequence[jax.Array]) -> _Geometry:
    """What a plan depends on: every array's shape, dtype and sharding, and whether the
    first is committed (where the jit places uncommitted ones)."""
    arrays = tuple(
        (tuple(getattr(c, "shape", ())), getattr(c, "dtype", None), getattr(c, "sharding", None))
        for c in caches
    )
    return (arrays, bool(caches) and bool(getattr(caches[0], "committed", False)))


def _show(geometry: _Geometry) -> str:
    arrays = geometry[0]
    if not arrays:
        return "no arrays"
    shape, dtype, sharding = arrays[0]
    alike = all(a == arrays[0] for a in arrays)
    each = "" if alike else " (not all alike)"
    return f"{len(arrays)} x {dtype}{list(shape)} on {sharding}{each}"


def _ids_sharding(cache: jax.Array) -> jax.sharding.Sharding | None:
    """Block ids replicated over the caches' devices (where the kernels' jit wants them),
    or None for caches it places itself (uncommitted, or not a jax array)."""
    if not isinstance(cache, jax.Array) or not cache.committed:
        return None
    sharding = cache.sharding
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    return None
