"""The backend registry: one record per backend, which the API, the CLI and the docs read.

A ``Backend`` says what the backend is (its config class and kernels), where its
compiled kernels run (``supports``), and whether it has a CPU interpreter
(``can_interpret``). ``auto`` takes the first record, in registry order, that imported
and supports the caches' device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType

import jax

from .. import _compat
from . import mosaic_gpu, tpu, triton, xla
from .errors import BackendConfigError, BackendUnavailableError

_GPU = frozenset({"cuda"})


def device_platform(device: object) -> tuple[str, tuple[int, int] | None]:
    """``(platform, compute capability)`` of a jax device: "cpu", "tpu", "cuda" or
    "rocm" (jax calls both GPU kinds "gpu"); the capability only for CUDA devices."""
    platform = str(getattr(device, "platform", "")).lower()
    if platform == "gpu":
        version = str(getattr(getattr(device, "client", None), "platform_version", ""))
        platform = "rocm" if "rocm" in version.lower() else "cuda"
    capability = None
    cc = getattr(device, "compute_capability", None) if platform == "cuda" else None
    if cc:
        major, _, minor = str(cc).partition(".")
        capability = (int(major), int(minor or 0))
    return platform, capability


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Backend:
    """One gather/scatter backend.

    Attributes:
      name: what ``backend=`` takes.
      where: where its compiled kernels run, in words (the docs and errors quote it).
      how: how it moves a page, in one line.
      config: its frozen config class, or None (``reference`` takes no config).
      kernels: the module whose ``gather_words`` / ``scatter_words`` move word views
        (None for ``reference``, which moves whole pages with plain ``jnp``).
      platforms: platforms its compiled code runs on ("cpu", "tpu", "cuda", "rocm");
        None: every platform.
      min_capability: lowest CUDA compute capability, where one is needed.
      interpreter: the CPU interpreter ``interpret=True`` selects, in words; None when
        the backend has no interpret mode (then ``interpret`` is ignored).
      interpreter_models_devices: the interpreter simulates devices and synchronises
        them (TPU, Mosaic GPU): run one device at a time (see ``mesh.py``).
    """

    name: str
    where: str
    how: str
    config: type | None
    kernels: ModuleType | None
    platforms: frozenset[str] | None
    min_capability: tuple[int, int] | None = None
    interpreter: str | None = None
    interpreter_models_devices: bool = False
    _import_error: Callable[[], str] = dataclasses.field(default=lambda: "", repr=False)
    _interpret_params: Callable[[], object] | None = dataclasses.field(default=None, repr=False)
    _params_type: Callable[[], type | None] = dataclasses.field(default=lambda: None, repr=False)

    @property
    def import_error(self) -> str:
        """Why its Pallas module did not import ("" when it did)."""
        return self._import_error()

    @property
    def available(self) -> bool:
        """Its Pallas module imported (always true for ``xla`` and ``reference``)."""
        return not self.import_error

    def supports(
        self, where: jax.Device | str, compute_capability: tuple[int, int] | None = None
    ) -> bool:
        """Whether its compiled kernels run on ``where``: a jax device, or a platform
        name ("cpu", "tpu", "gpu"/"cuda", "rocm"; then pass ``compute_capability`` to
        check a minimum, which a device carries itself)."""
        if isinstance(where, str):
            platform = {"gpu": "cuda"}.get(where.lower(), where.lower())
            capability = compute_capability
        elif not hasattr(where, "platform"):
            raise TypeError(
                f"where must be a jax device or a platform name ('cpu', 'tpu', 'gpu', "
                f"'rocm'), got {type(where).__name__} {where!r}; e.g. jax.devices()[0]"
            )
        else:
            platform, capability = device_platform(where)
        if not self.available:
            return False
        if self.platforms is None:
            return True
        if platform not in self.platforms:
            return False
        if self.min_capability is None:
            return True
        if capability is None:  # a platform name alone: the minimum cannot be checked
            return isinstance(where, str)
        return capability >= self.min_capability

    def can_interpret(self) -> bool:
        """Whether ``interpret=True`` can run its kernels here (on any platform)."""
        if self.interpreter is None or not self.available:
            return False
        return self._interpret_params is None or self._interpret_params() is not None

    def interpret_params(self) -> object:
        """What ``interpret=True`` passes to Pallas: the backend's interpreter params
        (TPU, Mosaic GPU) or True (Triton's HLO interpreter)."""
        return True if self._interpret_params is None else self._interpret_params()

    def params_type(self) -> type | None:
        """The interpreter params class ``interpret=`` may also take, or None."""
        return self._params_type()


_REGISTRY: tuple[Backend, ...] = (
    Backend(
        name="tpu",
        where="TPU",
        how="ids scalar-prefetched into SMEM; HBM -> HBM async DMAs, a window in flight",
        config=tpu.TpuConfig,
        kernels=tpu,
        platforms=frozenset({"tpu"}),
        interpreter="the TPU interpreter (InterpretParams: DMAs, semaphores, aliasing)",
        interpreter_models_devices=True,
        _import_error=lambda: _compat.TPU_IMPORT_ERROR,
        _interpret_params=_compat.tpu_interpret_params,
        _params_type=lambda: getattr(_compat.pltpu, "InterpretParams", None),
    ),
    Backend(
        name="mosaic_gpu",
        where="NVIDIA GPUs of compute capability 9.0 or newer (Hopper, Blackwell)",
        how="TMA copies GMEM -> SMEM -> GMEM, several stages in flight per CTA",
        config=mosaic_gpu.MosaicGpuConfig,
        kernels=mosaic_gpu,
        platforms=_GPU,
        min_capability=(9, 0),
        interpreter="the Mosaic GPU interpreter (InterpretGPUParams; one CTA)",
        interpreter_models_devices=True,
        _import_error=lambda: _compat.MOSAIC_GPU_IMPORT_ERROR,
        _interpret_params=_compat.gpu_interpret_params,
        _params_type=_compat.gpu_interpret_params_type,
    ),
    Backend(
        name="triton",
        where="NVIDIA GPUs (CUDA)",
        how="ids as an operand; pointer gather of power-of-two page chunks",
        config=triton.TritonConfig,
        kernels=triton,
        platforms=_GPU,
        interpreter="the HLO interpreter (interpret=True)",
        _import_error=lambda: _compat.TRITON_IMPORT_ERROR,
    ),
    Backend(
        name="xla",
        where="every platform (the CPU path and the fallback)",
        how="fenced integer-word .at[ids].get / .at[ids].set",
        config=xla.XlaConfig,
        kernels=xla,
        platforms=None,
    ),
    Backend(
        name="reference",
        where="every platform (the oracle, plain jnp)",
        how="jnp.take / .at[].set on same-width integer views",
        config=None,
        kernels=None,
        platforms=None,
    ),
)
_BY_NAME = {b.name: b for b in _REGISTRY}
_BUILTIN = frozenset(_BY_NAME)

BACKENDS = ("auto", *_BY_NAME)


def list_backends() -> tuple[Backend, ...]:
    """Every backend's record, in the order ``auto`` prefers them."""
    return _REGISTRY


def get_backend(name: str) -> Backend:
    """The record of backend ``name`` (not "auto": see ``pick_backend``)."""
    if not isinstance(name, str):
        raise TypeError(
            f"backend must be a str, one of {BACKENDS}, got {type(name).__name__} {name!r}"
        )
    if name not in _BY_NAME:
        raise BackendUnavailableError(
            f"backend must be one of {BACKENDS}, got {name!r}; 'auto' picks the best one "
            "the caches' platform runs"
        )
    return _BY_NAME[name]


def available_backends() -> tuple[str, ...]:
    """Backends whose Pallas module imported (``xla`` and ``reference`` always)."""
    return tuple(b.name for b in _REGISTRY if b.available)


def default_device() -> jax.Device:
    return jax.devices()[0]


def supported_backends(
    where: jax.Device | str | None = None, *, interpret: bool = False
) -> tuple[str, ...]:
    """Backends that run on ``where`` (a device or platform name; None: jax's default
    device), compiled; with ``interpret=True`` also those that can run in a CPU
    interpreter there. ``auto`` is always accepted on top of these."""
    where = default_device() if where is None else where
    return tuple(
        b.name for b in _REGISTRY if b.supports(where) or (interpret and b.can_interpret())
    )


def pick_backend(device: jax.Device) -> Backend:
    """What ``auto`` runs on ``device``: the first record that imported and supports it."""
    return next(b for b in _REGISTRY if b.supports(device))


def register_backend(backend: Backend) -> None:
    """Adds a backend at run time: ``backend=<its name>`` selects it everywhere (the API,
    ``list_backends``, the engines). It goes after the built-in records, so ``auto``
    keeps picking those (``xla`` runs everywhere). A backend of this package is a record
    in ``_REGISTRY`` instead, where its position is ``auto``'s preference.

    Raises:
      TypeError: ``backend`` is not a ``Backend``, or its ``kernels`` lack
        ``gather_words`` / ``scatter_words``.
      BackendConfigError: its name is "auto" or already taken.
    """
    global _REGISTRY
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a Backend record, got {type(backend).__name__}")
    if backend.name == "auto" or backend.name in _BY_NAME:
        raise BackendConfigError(
            f"backend name {backend.name!r} is taken: registered are {tuple(_BY_NAME)} "
            "(and 'auto'); pick another name"
        )
    missing = [f for f in ("gather_words", "scatter_words") if not callable(
        getattr(backend.kernels, f, None))]  # fmt: skip
    if missing:
        raise TypeError(
            f"backend {backend.name!r}: its kernels ({backend.kernels!r}) lack {missing}; "
            "give a module or object with gather_words(words, block_ids, *, config, "
            "interpret) and scatter_words(words, block_ids, staging, *, config, interpret)"
        )
    _BY_NAME[backend.name] = backend
    _REGISTRY = (*_REGISTRY, backend)


def unregister_backend(name: str) -> Backend:
    """Removes a backend ``register_backend`` added and returns its record."""
    global _REGISTRY
    if name in _BUILTIN or name not in _BY_NAME:
        what = "built in" if name in _BUILTIN else "not registered"
        raise BackendUnavailableError(f"backend {name!r} is {what}; registered: {tuple(_BY_NAME)}")
    _REGISTRY = tuple(b for b in _REGISTRY if b.name != name)
    return _BY_NAME.pop(name)
