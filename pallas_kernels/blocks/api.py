"""Public entry: ``gather_blocks`` / ``scatter_blocks``, input checks and backend choice.

Every backend except ``reference`` moves unsigned integer words (``layout.to_words``):
copies move bits, never values, so results are bit-exact for every dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from . import mosaic_gpu, reference, tpu, triton, xla
from .checks import check_block_ids, check_caches, check_staging
from .errors import BackendUnavailableError
from .layout import (
    KVLayout,
    KVStacking,
    bitcast_last,
    default_word_bytes,
    from_words,
    page_bytes,
    to_words,
)
from .mesh import local_plan

BACKENDS = ("auto", "mosaic_gpu", "triton", "tpu", "xla", "reference")

_CONFIGS = {
    "mosaic_gpu": mosaic_gpu.MosaicGpuConfig,
    "triton": triton.TritonConfig,
    "tpu": tpu.TpuConfig,
    "xla": xla.XlaConfig,
}
_KERNELS = {"mosaic_gpu": mosaic_gpu, "triton": triton, "tpu": tpu}
_IMPORT_ERRORS = {
    "mosaic_gpu": lambda: _compat.MOSAIC_GPU_IMPORT_ERROR,
    "triton": lambda: _compat.TRITON_IMPORT_ERROR,
    "tpu": lambda: _compat.TPU_IMPORT_ERROR,
}


def available_backends() -> tuple[str, ...]:
    """Backends whose Pallas module imported (``xla`` and ``reference`` always)."""
    return tuple(b for b in BACKENDS[1:] if b not in _IMPORT_ERRORS or not _IMPORT_ERRORS[b]())


def _platform_backend(cache: Any) -> str:
    """``auto``: TPU kernels on TPU, Mosaic GPU on Hopper+ (TMA), Triton on older GPUs."""
    try:
        device = next(iter(cache.devices()))
    except Exception:  # a tracer (outer jit) or a ShapeDtypeStruct has no devices
        device = jax.devices()[0]
    have = available_backends()
    if device.platform == "tpu" and "tpu" in have:
        return "tpu"
    if device.platform in ("gpu", "cuda"):
        major = int(str(getattr(device, "compute_capability", "0")).split(".")[0])
        if major >= 9 and "mosaic_gpu" in have:
            return "mosaic_gpu"
        if "triton" in have:
            return "triton"
    return "xla"


def _resolve(backend: str, cache: Any, config: Any, interpret: Any) -> tuple[str, Any, Any]:
    if backend not in BACKENDS:
        raise BackendUnavailableError(f"backend must be one of {BACKENDS}, got {backend!r}")
    name = _platform_backend(cache) if backend == "auto" else backend
    if name in _IMPORT_ERRORS and _IMPORT_ERRORS[name]():
        raise BackendUnavailableError(
            f"backend={name!r} is unavailable: its Pallas module failed to import "
            f"({_IMPORT_ERRORS[name]()}); use backend='xla'"
        )
    if name == "reference":
        if config is not None:
            raise TypeError(f"backend='reference' takes no config, got {type(config).__name__}")
        return name, None, False
    cls = _CONFIGS[name]
    if config is None:
        config = cls()
    elif not isinstance(config, cls):
        raise TypeError(
            f"config for backend={name!r} must be a {cls.__name__}, got "
            f"{type(config).__name__}; pass {cls.__name__}(...) or None for the default"
        )
    if name == "xla" or interpret is False or interpret is None:
        return name, config, False
    if interpret is True:
        # The most faithful interpreter each backend has (jax 0.10.2): the TPU one models
        # DMAs and aliasing; Mosaic GPU TMA kernels run only in the GPU interpreter.
        if name == "tpu":
            interpret = _compat.tpu_interpret_params()
        elif name == "mosaic_gpu":
            interpret = _compat.gpu_interpret_params()
            if interpret is None:
                raise BackendUnavailableError(
                    "backend='mosaic_gpu' with interpret=True needs the Mosaic GPU "
                    "interpreter, which this jax does not ship; test it on a GPU"
                )
    return name, config, interpret


def _word_bytes(cache: Any, layout: KVLayout, config: Any, *, widen: bool = True) -> int:
    w = getattr(config, "word_bytes", None)
    if w is None:
        if not widen:
            return np.dtype(cache.dtype).itemsize
        return default_word_bytes(tuple(cache.shape), cache.dtype, layout)
    outer = 2 if layout.kv_stacking is KVStacking.FIRST else 1
    half = page_bytes(tuple(cache.shape), cache.dtype, layout) // outer
    if w not in (1, 2, 4) or half % w:
        raise ValueError(
            f"config.word_bytes={w} must be 1, 2 or 4 and divide the page ({half} bytes per "
            "K/V half); use None for the default"
        )
    return w


def _staging_shape(caches: Sequence[Any], n: int, layout: KVLayout) -> tuple[int, ...]:
    return (n, len(caches), *layout.page_shape(tuple(caches[0].shape)))


@functools.partial(jax.jit, static_argnames=("layout", "backend", "config", "interpret", "local"))
def _gather(caches, block_ids, *, layout, backend, config, interpret, local):
    if local is None:
        return _gather_body(caches, block_ids, layout, backend, config, interpret)
    body = functools.partial(
        _gather_body, layout=layout, backend=backend, config=config, interpret=interpret
    )
    return local.run(body, len(caches), with_staging=False)(tuple(caches), block_ids)


def _gather_body(caches, block_ids, layout, backend, config, interpret):
    if backend == "reference":
        return reference.gather_blocks_reference(caches, block_ids, layout=layout)
    # The XLA path keeps the element width (see _scatter_body): on XLA:CPU a widening
    # bitcast materialises the whole cache even for a one-block gather (0.6 s per call
    # on a 1 GiB cache, measured), while a same-width view costs nothing.
    wb = _word_bytes(caches[0], layout, config, widen=backend != "xla")
    words = [to_words(c, layout, wb) for c in caches]
    if backend == "xla":
        out = xla.gather_words(words, block_ids)
    else:
        out = _KERNELS[backend].gather_words(words, block_ids, config=config, interpret=interpret)
    return from_words(out, _staging_shape(caches, block_ids.shape[0], layout), caches[0].dtype)


def _scatter_impl(
    caches, block_ids, staging, *, layout, backend, config, interpret, shardings, local
):
    if local is not None:  # each device writes its own shard; shardings are kept

        def body(cs, ids, st):
            return tuple(_scatter_body(cs, ids, st, layout, backend, config, interpret))

        out = local.run(body, len(caches), with_staging=True)(tuple(caches), block_ids, staging)
        return list(out)
    out = _scatter_body(caches, block_ids, staging, layout, backend, config, interpret)
    if shardings is not None:
        # Keep each cache's sharding: otherwise XLA may pick another (e.g. replicated)
        # for the output, the donated buffers cannot be reused and the cache is copied.
        out = [jax.lax.with_sharding_constraint(o, s) for o, s in zip(out, shardings, strict=True)]
    return out


def _scatter_body(caches, block_ids, staging, layout, backend, config, interpret):
    if backend == "reference":
        return reference.scatter_blocks_reference(caches, block_ids, staging, layout=layout)
    # XLA scatters in place only on the cache's own element type: a widening bitcast of
    # the operand makes XLA:CPU copy the whole cache per call (0.4-0.9 s for a one-block
    # update of a 1 GiB cache, measured), so the XLA path keeps the element width.
    wb = _word_bytes(caches[0], layout, config, widen=backend != "xla")
    words = [to_words(c, layout, wb) for c in caches]
    outer = words[0].shape[0]
    n = block_ids.shape[0]
    staged = bitcast_last(staging.reshape(n, len(caches), outer, -1), wb)
    if backend == "xla":
        out = xla.scatter_words(words, block_ids, staged)
    else:
        out = _KERNELS[backend].scatter_words(
            words, block_ids, staged, config=config, interpret=interpret
        )
    return [from_words(o, c.shape, c.dtype) for o, c in zip(out, caches, strict=True)]


_STATIC = ("layout", "backend", "config", "interpret", "shardings", "local")
_scatter_donating = jax.jit(_scatter_impl, static_argnames=_STATIC, donate_argnums=0)
_scatter_keeping = jax.jit(_scatter_impl, static_argnames=_STATIC)


def gather_blocks(
    caches: Sequence[jax.Array],
    block_ids: jax.Array,
    *,
    layout: KVLayout,
    backend: str = "auto",
    config: Any = None,
    interpret: Any = False,
) -> jax.Array:
    """Gathers pages of ``block_ids`` from every array into one contiguous staging array.

    Args:
      caches: arrays of one shape and dtype (layers, or K and V), each in ``layout``.
      block_ids: int32 ``[n]``, each in ``[0, num_blocks)``; duplicates allowed.
      layout: the ``KVLayout`` of every array.
      backend: one of ``BACKENDS``; ``auto`` picks by the caches' platform.
      config: the backend's frozen config (``TpuConfig``, ...); None for its default.
      interpret: Pallas backends only: True runs the kernel in that backend's
        interpreter on CPU, or pass an interpreter params object.

    Returns:
      ``[n, len(caches), *page_shape]`` in the caches' dtype, block-major: entry i holds
      every array's page of ``block_ids[i]`` back to back. For caches sharded over a
      mesh along page axes (not the block axis), each device gathers its own shard and
      the staging is sharded the same way (``staging_sharding``).
    """
    caches = check_caches(caches, layout)
    nb = layout.num_blocks(tuple(caches[0].shape))
    block_ids = check_block_ids(block_ids, nb, unique=False)
    backend, config, interpret = _resolve(backend, caches[0], config, interpret)
    n = block_ids.shape[0]
    if n == 0:
        return jnp.zeros(_staging_shape(caches, 0, layout), caches[0].dtype)
    return _gather(
        tuple(caches),
        jnp.asarray(block_ids),
        layout=layout,
        backend=backend,
        config=config,
        interpret=interpret,
        local=local_plan(caches, layout),
    )


def scatter_blocks(
    caches: Sequence[jax.Array],
    block_ids: jax.Array,
    staging: jax.Array,
    *,
    layout: KVLayout,
    backend: str = "auto",
    config: Any = None,
    interpret: Any = False,
) -> list[jax.Array]:
    """Writes ``staging[i]`` into page ``block_ids[i]`` of every array, in place.

    The caches are donated (``input_output_aliases`` in the kernels): after the call the
    arrays passed in are deleted and the returned list holds the updated caches in the
    same buffers. Inside an outer ``jax.jit``, donate the caches there instead.

    Args:
      caches: as for ``gather_blocks``.
      block_ids: int32 ``[n]``, unique, each in ``[0, num_blocks)``.
      staging: ``[n, len(caches), *page_shape]`` in the caches' dtype.
      layout, backend, config, interpret: as for ``gather_blocks``.

    Returns:
      The updated caches, a list in the order given.
    """
    caches = check_caches(caches, layout)
    nb = layout.num_blocks(tuple(caches[0].shape))
    block_ids = check_block_ids(block_ids, nb, unique=True)
    n = block_ids.shape[0]
    check_staging(staging, _staging_shape(caches, n, layout), caches[0].dtype)
    backend, config, interpret = _resolve(backend, caches[0], config, interpret)
    if n == 0:
        return list(caches)
    # Interpreted kernels run as host loops that cannot reuse a donated buffer, and XLA
    # warns about every unusable donation; donate only where the kernel aliases for real.
    fn = _scatter_keeping if interpret else _scatter_donating
    return fn(
        tuple(caches),
        jnp.asarray(block_ids),
        staging,
        layout=layout,
        backend=backend,
        config=config,
        interpret=interpret,
        shardings=_mesh_shardings(caches),
        local=local_plan(caches, layout),
    )


def _mesh_shardings(caches: Sequence[Any]) -> tuple[Any, ...] | None:
    """The caches' shardings when they span several devices (a jit static), else None."""
    shardings = tuple(getattr(c, "sharding", None) for c in caches)
    if any(not isinstance(s, jax.sharding.NamedSharding) for s in shardings):
        return None
    if all(len(s.device_set) == 1 for s in shardings):
        return None
    return shardings
