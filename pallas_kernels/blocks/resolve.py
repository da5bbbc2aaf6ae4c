"""Backend choice for one call: the record, its config and its interpreter, checked
against the caches' platform before anything is traced."""

from __future__ import annotations

import jax
import numpy as np

from .backends import (
    Backend,
    default_device,
    device_platform,
    get_backend,
    pick_backend,
    supported_backends,
)
from .errors import BackendConfigError, BackendUnavailableError
from .layout import KVLayout, KVStacking, page_bytes


def cache_device(cache: object) -> jax.Device | None:
    """The (first) device a call on ``cache`` runs on: its own for a jax array, jax's
    default device for a host (numpy) array, None for a tracer (unknown until lowering)."""
    if isinstance(cache, jax.core.Tracer):
        return None
    if not isinstance(cache, jax.Array):
        return default_device()
    return min(cache.sharding.device_set, key=lambda d: d.id)  # type: ignore[attr-defined]


def _platform_words(device: jax.Device) -> str:
    platform, capability = device_platform(device)
    if capability is not None:
        platform += f" (compute capability {capability[0]}.{capability[1]})"
    return platform


def resolve(
    backend: str, cache: jax.Array, config: object, interpret: object
) -> tuple[Backend, object, object]:
    """``(record, config, interpret)`` for this call; raises a typed error naming what
    runs instead. ``interpret`` comes back as False, True or an interpreter params object.

    The platform is checked only for concrete arrays: under an outer ``jax.jit`` the
    lowering platform is not known here (``lower(lowering_platforms=...)`` may target a
    GPU or TPU from a CPU host).
    """
    device = cache_device(cache)
    where = device if device is not None else default_device()
    if isinstance(backend, str) and backend == "auto":
        record = pick_backend(where)
    else:
        record = get_backend(backend)
    if not record.available:
        raise BackendUnavailableError(
            f"backend={record.name!r} is unavailable: its Pallas module failed to import "
            f"({record.import_error}); on {_platform_words(where)} use one of "
            f"{supported_backends(where)} or 'auto'"
        )
    config = _config(record, config)
    interpret = _interpret(record, interpret)
    if not interpret and device is not None and not record.supports(device):
        hint = (
            f", or pass interpret=True to run {record.name}'s kernels in "
            f"{record.interpreter} on any platform (slow; for tests)"
            if record.can_interpret()
            else ""
        )
        raise BackendUnavailableError(
            f"backend={record.name!r} compiles only for {record.where}, but the caches are "
            f"on {_platform_words(device)} ({device}); use one of "
            f"{supported_backends(device)} or 'auto' there{hint}"
        )
    return record, config, interpret


def _config(record: Backend, config: object) -> object:
    if record.config is None:
        if config is not None:
            raise TypeError(
                f"backend={record.name!r} takes no config, got {type(config).__name__}; "
                "pass config=None"
            )
        return None
    if config is None:
        return record.config()
    if not isinstance(config, record.config):
        name = record.config.__name__
        raise TypeError(
            f"config for backend={record.name!r} must be a {name}, got "
            f"{type(config).__name__}; pass {name}(...) or None for the default"
        )
    return config


def _interpret(record: Backend, interpret: object) -> object:
    params_type = record.params_type()
    if not (
        interpret is None
        or isinstance(interpret, bool)
        or (params_type is not None and isinstance(interpret, params_type))
        or (record.interpreter is None and _is_params_object(interpret))
    ):
        allowed = "a bool" + (f" or a {params_type.__name__}" if params_type else "")
        raise TypeError(
            f"interpret for backend={record.name!r} must be {allowed}, got "
            f"{type(interpret).__name__} {interpret!r}; True picks {record.name}'s "
            f"interpreter ({record.interpreter or 'none: the argument is ignored'})"
        )
    if record.interpreter is None or not interpret:
        return False  # xla and reference are plain XLA everywhere: nothing to interpret
    if interpret is True:
        if not record.can_interpret():
            raise BackendUnavailableError(
                f"backend={record.name!r} with interpret=True needs {record.interpreter}, "
                f"which this jax ({jax.__version__}) does not ship; test {record.name} on "
                "its hardware, or interpret another backend"
            )
        return record.interpret_params()
    return interpret


def _is_params_object(value: object) -> bool:
    # Any backend's interpreter params: the engine forwards one ``interpret`` to whatever
    # backend ``auto`` picks, and xla/reference ignore it.
    return type(value).__name__ in ("InterpretParams", "InterpretGPUParams")


def word_bytes(cache: jax.Array, layout: KVLayout, config: object, *, widen: bool = True) -> int:
    """Width of the words moved: the config's, else the widest dividing a page half
    (``widen``) or the element width."""
    from .layout import default_word_bytes

    w: int | None = getattr(config, "word_bytes", None)
    if w is None:
        if not widen:
            return np.dtype(cache.dtype).itemsize
        return default_word_bytes(tuple(cache.shape), cache.dtype, layout)
    return w


def check_word_bytes(cache: jax.Array, layout: KVLayout, config: object) -> None:
    """``config.word_bytes`` divides a page half of these caches."""
    w = getattr(config, "word_bytes", None)
    if w is None:
        return
    outer = 2 if layout.kv_stacking is KVStacking.FIRST else 1
    half = page_bytes(tuple(cache.shape), cache.dtype, layout) // outer
    if half % w:
        fits = [x for x in (4, 2, 1) if half % x == 0]
        raise BackendConfigError(
            f"{type(config).__name__}.word_bytes={w} must divide the page of these caches "
            f"({half} bytes per {'K/V half' if outer == 2 else 'page'}); use one of {fits} "
            "or None for the default"
        )
