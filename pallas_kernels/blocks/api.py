"""Public entry: ``gather_blocks`` / ``scatter_blocks``, input checks and backend choice.

Every backend except ``reference`` moves unsigned integer words (``layout.to_words``):
copies move bits, never values, so results are bit-exact for every dtype. The one
exception is the XLA scatter of a cache whose own type keeps every bit (integers, fp32:
``xla.scatter_pages``), which XLA then updates in place.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from . import mesh, reference, xla
from .backends import Backend, get_backend
from .checks import check_block_ids, check_caches, check_staging
from .layout import (
    KVLayout,
    as_bits,
    as_dtype,
    bitcast_last,
    fenced,
    from_words,
    is_integer,
    to_words,
)
from .resolve import check_word_bytes, resolve, word_bytes

# A run-time 0 passed to every jitted body (``layout.fenced``): XLA cannot fold it.
_ZERO = np.zeros((), np.uint32)


def _fence(zero, backend, interpret, dtype):
    # XLA-compiled copies of float caches (the XLA and reference backends, and every
    # interpreted kernel, which runs as ordinary HLO or host callbacks) are fenced.
    # Integer caches never hold a float, so they keep exactly the HLO they had; compiled
    # Pallas kernels move words in their own code, where an xor would cost an extra pass
    # over the data.
    if is_integer(dtype):
        return None
    return zero if backend in ("xla", "reference") or interpret else None


def _staging_shape(caches: Sequence[jax.Array], n: int, layout: KVLayout) -> tuple[int, ...]:
    return (n, len(caches), *layout.page_shape(tuple(caches[0].shape)))


@functools.partial(jax.jit, static_argnames=("layout", "backend", "config", "interpret", "local"))
def _gather(caches, block_ids, zero, *, layout, backend, config, interpret, local):
    if local is None:
        return _gather_body(caches, block_ids, zero, layout, backend, config, interpret)
    kw = {"layout": layout, "backend": backend, "config": config, "interpret": interpret}
    if local.block_axes:
        body = functools.partial(_gather_owned, plan=local, **kw)
    else:
        body = functools.partial(_gather_body, **kw)
    return local.run(body, len(caches), with_staging=False)(tuple(caches), block_ids, zero)


def _gather_owned(caches, block_ids, zero, layout, backend, config, interpret, plan):
    """One device of a mesh that splits the blocks (``mesh.LocalPlan``): the rows of the
    ids it owns, combined with the other devices' over the block axes."""
    local, owned = plan.owned_ids(block_ids, layout.num_blocks(caches[0].shape))
    ids = jnp.where(owned, local, 0)
    staging = _gather_body(caches, ids, zero, layout, backend, config, interpret)
    return plan.combine_rows(staging, owned)


def _gather_body(caches, block_ids, zero, layout, backend, config, interpret):
    fence = _fence(zero, backend, interpret, caches[0].dtype)
    if backend == "reference":
        return reference.gather_pages(caches, block_ids, layout, fence)
    # The XLA path keeps the element width (see _scatter_body): on XLA:CPU a widening
    # bitcast materialises the whole cache even for a one-block gather (0.6 s per call
    # on a 1 GiB cache, measured), while a same-width view costs nothing.
    wb = word_bytes(caches[0], layout, config, widen=backend != "xla")
    words = [to_words(c, layout, wb) for c in caches]
    if backend == "xla":
        out = xla.gather_words(words, block_ids)
    else:
        kernels = cast(ModuleType, get_backend(backend).kernels)  # every Pallas backend's
        out = kernels.gather_words(words, block_ids, config=config, interpret=interpret)
    out = fenced(out, fence)
    return from_words(out, _staging_shape(caches, block_ids.shape[0], layout), caches[0].dtype)


def _scatter_impl(
    caches, block_ids, staging, zero, *, layout, backend, config, interpret, shardings, local
):
    if local is not None:  # each device writes its own shard; shardings are kept
        write = _scatter_owned if local.block_axes else _scatter_body
        kw = {"layout": layout, "backend": backend, "config": config, "interpret": interpret}
        if local.block_axes:
            kw["plan"] = local

        def body(cs, ids, z, st):
            return tuple(write(cs, ids, st, z, **kw))

        run = local.run(body, len(caches), with_staging=True)
        return list(run(tuple(caches), block_ids, zero, staging))
    out = _scatter_body(caches, block_ids, staging, zero, layout, backend, config, interpret)
    if shardings is not None:
        # Keep each cache's sharding: otherwise XLA may pick another (e.g. replicated)
        # for the output, the donated buffers cannot be reused and the cache is copied.
        out = [jax.lax.with_sharding_constraint(o, s) for o, s in zip(out, shardings, strict=True)]
    return out


def _scatter_body(caches, block_ids, staging, zero, layout, backend, config, interpret):
    fence = _fence(zero, backend, interpret, caches[0].dtype)
    if backend == "reference":
        return reference.scatter_pages(caches, block_ids, staging, layout, fence)
    # XLA scatters in place only on the cache's own element type: a widening bitcast of
    # the operand makes XLA:CPU copy the whole cache per call (0.4-0.9 s for a one-block
    # update of a 1 GiB cache, measured), so the XLA path keeps the element width.
    wb = word_bytes(caches[0], layout, config, widen=backend != "xla")
    if backend == "xla" and wb == np.dtype(caches[0].dtype).itemsize:
        return xla.scatter_pages(caches, block_ids, staging, layout, fence)
    # Untouched pages too: XLA:CPU copies a float cache before scattering into it (it
    # updates in place only on the operand's own type), and that copy must not run on
    # bf16 values either (``fence`` is None for integer caches).
    words = [fenced(to_words(c, layout, wb), fence) for c in caches]
    outer = words[0].shape[0]
    n = block_ids.shape[0]
    staged = fenced(bitcast_last(as_bits(staging).reshape(n, len(caches), outer, -1), wb), fence)
    if backend == "xla":
        out = xla.scatter_words(words, block_ids, staged)
    else:
        out = cast(ModuleType, get_backend(backend).kernels).scatter_words(
            words, block_ids, staged, config=config, interpret=interpret
        )
    return [from_words(o, c.shape, c.dtype) for o, c in zip(out, caches, strict=True)]


def _scatter_owned(caches, block_ids, staging, zero, layout, backend, config, interpret, plan):
    """One device of a mesh that splits the blocks (``mesh.LocalPlan``): writes the rows
    of the ids it owns. An entry it does not own rewrites the first owned entry's page
    with that entry's row, or, when it owns none, its block 0 with the bytes block 0
    holds: every id the kernel sees is in the shard, and no page changes but its own."""
    local, owned = plan.owned_ids(block_ids, layout.num_blocks(caches[0].shape))
    first = jnp.argmax(owned)  # the first owned entry (0 when none is)
    some = owned[first]
    zero_id = jnp.zeros((1,), block_ids.dtype)
    unchanged = as_bits(_gather_body(caches, zero_id, zero, layout, backend, config, interpret))
    bits = as_bits(staging)
    spare = jnp.where(some, bits[first][None], unchanged)
    ids = jnp.where(owned, local, jnp.where(some, local[first], 0))
    rows = jnp.where(owned.reshape(-1, *(1,) * (bits.ndim - 1)), bits, spare)
    rows = as_dtype(rows, staging.dtype)
    return _scatter_body(caches, ids, rows, zero, layout, backend, config, interpret)


_STATIC = ("layout", "backend", "config", "interpret", "shardings", "local")
_scatter_donating = jax.jit(_scatter_impl, static_argnames=_STATIC, donate_argnums=0)
_scatter_keeping = jax.jit(_scatter_impl, static_argnames=_STATIC)


def _ids_arg(block_ids: jax.Array | np.ndarray) -> jax.Array | np.ndarray:
    # Concrete ids go in as numpy: jit then places them with the caches, wherever a
    # caller's committed ids array happens to live.
    if isinstance(block_ids, jax.core.Tracer):
        return block_ids
    return np.asarray(block_ids)


def _one_device_at_a_time(record: Backend, interpret: object, caches: Sequence[jax.Array]) -> bool:
    return bool(interpret) and record.interpreter_models_devices and mesh.spans_devices(caches)


def gather_blocks(
    caches: Sequence[jax.Array],
    block_ids: jax.Array | np.ndarray,
    *,
    layout: KVLayout,
    backend: str = "auto",
    config: object = None,
    interpret: object = False,
) -> jax.Array:
    """Gathers pages of ``block_ids`` from every array into one contiguous staging array.

    Args:
      caches: arrays of one shape and dtype (layers, or K and V), each in ``layout``.
      block_ids: int32 ``[n]``, each in ``[0, num_blocks)``; duplicates allowed.
      layout: the ``KVLayout`` of every array.
      backend: one of ``BACKENDS``; ``auto`` picks by the caches' platform. A backend
        that does not run on the caches' platform raises ``BackendUnavailableError``
        (``supported_backends()`` lists those that do).
      config: the backend's frozen config (``TpuConfig``, ...); None for its default.
      interpret: Pallas backends only (ignored by ``xla``/``reference``): True runs the
        kernel in that backend's CPU interpreter, or pass an interpreter params object.
        The TPU and Mosaic GPU interpreters run caches spread over several devices one
        shard at a time on one device (they hang when several devices run at once).

    Returns:
      ``[n, len(caches), *page_shape]`` in the caches' dtype, block-major: entry i holds
      every array's page of ``block_ids[i]`` back to back. For caches sharded over a
      mesh along page axes, each device gathers its own shard and the staging is
      sharded the same way (``staging_sharding``); with the block axis split too, each
      device gathers the blocks it holds and the staging is whole along the mesh axes
      that split the blocks.
    """
    caches = check_caches(caches, layout)
    nb = layout.num_blocks(tuple(caches[0].shape))
    block_ids = check_block_ids(block_ids, nb, unique=False)
    record, config, interpret = resolve(backend, caches[0], config, interpret)
    check_word_bytes(caches[0], layout, config)
    n = block_ids.shape[0]
    if n == 0:
        return jnp.zeros(_staging_shape(caches, 0, layout), caches[0].dtype)
    kw = {"layout": layout, "backend": record.name, "config": config, "interpret": interpret}
    ids = _ids_arg(block_ids)
    if _one_device_at_a_time(record, interpret, caches):
        return mesh.gather_one_device_at_a_time(
            caches, layout, lambda cs: _gather(tuple(cs), ids, _ZERO, local=None, **kw)
        )
    local = mesh.local_plan(caches, layout)
    zero = mesh.run_time_zero(caches, _ZERO)
    staging: jax.Array = _gather(tuple(caches), ids, zero, local=local, **kw)
    if local is not None and _closed_over(staging, caches):
        staging = _gather(_constant_bits(caches), ids, _ZERO, local=local, **kw)
        staging = as_dtype(staging, caches[0].dtype)
    return staging


def scatter_blocks(
    caches: Sequence[jax.Array],
    block_ids: jax.Array | np.ndarray,
    staging: jax.Array,
    *,
    layout: KVLayout,
    backend: str = "auto",
    config: object = None,
    interpret: object = False,
) -> list[jax.Array]:
    """Writes ``staging[i]`` into page ``block_ids[i]`` of every array, in place.

    The caches are donated (``input_output_aliases`` in the kernels): after the call the
    arrays passed in are deleted and the returned list holds the updated caches in the
    same buffers. Inside an outer ``jax.jit``, donate the caches there instead. In
    interpret mode nothing is donated.

    Args:
      caches: as for ``gather_blocks``.
      block_ids: int32 ``[n]``, unique, each in ``[0, num_blocks)``.
      staging: ``[n, len(caches), *page_shape]`` in the caches' dtype, on the caches'
        devices (or a host array).
      layout, backend, config, interpret: as for ``gather_blocks``.

    Returns:
      The updated caches, a list in the order given.
    """
    caches = check_caches(caches, layout)
    nb = layout.num_blocks(tuple(caches[0].shape))
    block_ids = check_block_ids(block_ids, nb, unique=True)
    n = block_ids.shape[0]
    check_staging(staging, _staging_shape(caches, n, layout), caches[0], layout)
    route = scatter_route(caches, layout, backend, config, interpret)
    if n == 0:
        return list(caches)
    return dispatch_scatter(route, caches, _ids_arg(block_ids), staging)


@dataclass(frozen=True, eq=False)
class ScatterRoute:
    """How a scatter on caches of one geometry runs, resolved once (``scatter_route``):
    the backend's options, whether it goes one device at a time (interpreters that
    cannot run several devices), and the per-device plan and shardings of a mesh."""

    layout: KVLayout
    kw: dict[str, object]  # the jitted bodies' static options, layout included
    one_device_at_a_time: bool
    local: mesh.LocalPlan | None
    shardings: tuple[NamedSharding, ...] | None


def scatter_route(
    caches: Sequence[jax.Array], layout: KVLayout, backend: str, config: object, interpret: object
) -> ScatterRoute:
    """The ``ScatterRoute`` of checked ``caches`` (``check_caches``); raises the typed
    errors of ``resolve`` and ``check_word_bytes``."""
    record, config, interpret = resolve(backend, caches[0], config, interpret)
    check_word_bytes(caches[0], layout, config)
    kw = {"layout": layout, "backend": record.name, "config": config, "interpret": interpret}
    if _one_device_at_a_time(record, interpret, caches):
        return ScatterRoute(layout, kw, True, None, None)
    local = mesh.local_plan(caches, layout)
    return ScatterRoute(layout, kw, False, local, _mesh_shardings(caches))


def dispatch_scatter(
    route: ScatterRoute,
    caches: Sequence[jax.Array],
    ids: jax.Array | np.ndarray,
    staging: jax.Array | np.ndarray,
) -> list[jax.Array]:
    """The scatter itself, on checked arguments (``scatter_blocks`` minus its checks)."""
    kw = route.kw
    if route.one_device_at_a_time:
        return mesh.scatter_one_device_at_a_time(
            caches,
            staging,
            route.layout,
            lambda cs, st: _scatter_keeping(
                tuple(cs), ids, st, _ZERO, shardings=None, local=None, **kw
            ),
        )
    # Interpreted kernels run as host loops that cannot reuse a donated buffer, and XLA
    # warns about every unusable donation; donate only where the kernel aliases for real.
    fn = _scatter_keeping if kw["interpret"] else _scatter_donating
    local, shardings = route.local, route.shardings
    staging = _staging_arg(staging, local)
    out: list[jax.Array] = fn(
        tuple(caches),
        ids,
        staging,
        mesh.run_time_zero(caches, _ZERO),
        shardings=shardings,
        local=local,
        **kw,
    )
    if local is not None and _closed_over(out[0], caches):
        bits = fn(
            _constant_bits(caches), ids, as_bits(jnp.asarray(staging)), _ZERO,
            shardings=shardings, local=local, **kw,
        )  # fmt: skip
        out = [as_dtype(o, caches[0].dtype) for o in bits]
    return out


def _closed_over(result: object, caches: Sequence[object]) -> bool:
    """An outer jit traced this call (``result`` is a tracer) with the caches as concrete
    arrays it closes over: it embeds them as float constants, which the partitioner
    slices per device as floats (XLA:CPU quiets bf16 NaN payloads on the way)."""
    return isinstance(result, jax.core.Tracer) and not any(
        isinstance(c, jax.core.Tracer) for c in caches
    )


def _constant_bits(caches: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """Concrete caches as their integer bits, computed now (not traced): an outer jit
    then embeds integer constants, which any slicing keeps bit for bit."""
    with jax.ensure_compile_time_eval():
        return tuple(as_bits(c) for c in caches)


def _staging_arg(
    staging: jax.Array | np.ndarray, local: mesh.LocalPlan | None
) -> jax.Array | np.ndarray:
    """A device staging sharded other than the per-device path wants, moved there as
    integers: resharded inside the jit, it would move as floats (XLA:CPU quiets bf16 NaN
    payloads and flushes subnormals on the way, issue 21)."""
    if local is None or not isinstance(staging, jax.Array):
        return staging
    if isinstance(staging, jax.core.Tracer):
        return staging
    want = local.staging_sharding
    if staging.sharding.is_equivalent_to(want, staging.ndim):
        return staging
    moved: jax.Array = jax.device_put(as_bits(staging), want)
    return moved


def _mesh_shardings(caches: Sequence[jax.Array]) -> tuple[NamedSharding, ...] | None:
    """The caches' shardings when they span several devices (a jit static), else None."""
    shardings = tuple(getattr(c, "sharding", None) for c in caches)
    if any(not isinstance(s, jax.sharding.NamedSharding) for s in shardings):
        return None
    named = cast("tuple[NamedSharding, ...]", shardings)
    if all(len(s.device_set) == 1 for s in named):
        return None
    return named
