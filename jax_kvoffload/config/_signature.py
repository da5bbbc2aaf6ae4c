"""Calls their signature refuses, as typed errors: an unknown keyword (a misspelt
option), a missing argument, too many positional ones.

Python raises a bare `TypeError` naming neither the parameters a constructor takes nor
the likely fix; `checked_arguments` wraps a public constructor (or function) so that
such a call raises `SignatureError` instead. A successful call costs nothing: the
signature is bound only after the call has raised a plain `TypeError`.
"""

from __future__ import annotations

import difflib
import enum
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import ParamSpec, TypeVar

from jax_kvoffload.config._errors import KVOffloadError, KVOffloadTypeError

_T = TypeVar("_T")
_P = ParamSpec("_P")
_R = TypeVar("_R")


class SignatureError(KVOffloadTypeError):
    """A call its signature does not take: `parameter` names the argument at fault."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


def _show(value: object) -> str:
    try:
        text = repr(value)
    except Exception:  # a value whose repr fails (a huge int, a broken object)
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def _error(
    name: str, sig: inspect.Signature, kwargs: Mapping[str, object], bad: TypeError
) -> SignatureError:
    params = [p for p in sig.parameters if p not in ("self", "cls")]
    listed = ", ".join(params)
    named = [p.name for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    unknown = [k for k in kwargs if k not in named]
    if unknown and not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        k = unknown[0]
        close = difflib.get_close_matches(k, params, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return SignatureError(
            f"{name}() takes no argument {k}={_show(kwargs[k])}; {hint}its parameters are "
            f"({listed}): drop it or fix its name",
            k,
        )
    reason = str(bad).split("() ", 1)[-1]  # "missing 1 required ...", "takes 2 ..."
    return SignatureError(
        f"{name}() {reason}; its parameters are ({listed}): pass each one it needs, the "
        "keyword-only ones by name"
    )


def _wrap(fn: Callable[_P, _R], name: str) -> Callable[_P, _R]:
    if getattr(fn, "_checked_arguments", False):
        return fn
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except TypeError as e:
            if isinstance(e, KVOffloadError):
                raise
            try:
                sig.bind(*args, **kwargs)
            except TypeError as bad:
                raise _error(name, sig, kwargs, bad) from None
            raise

    call._checked_arguments = True  # type: ignore[attr-defined]
    return call


def checked_arguments(target: _T) -> _T:
    """`target` (a class: its own `__init__`; or a function) raising `SignatureError`
    for calls its signature refuses. Usable as a decorator, above `@dataclass`."""
    if isinstance(target, type):
        init = target.__dict__.get("__init__")
        if init is not None:
            target.__init__ = _wrap(init, target.__name__)  # type: ignore[misc]
        return target
    return _wrap(target, getattr(target, "__qualname__", "function"))  # type: ignore[arg-type,return-value]


def check_arguments_of(classes: Iterable[object]) -> None:
    """`checked_arguments` on every class of `classes` (a package's exported names)."""
    for obj in classes:
        if isinstance(obj, type) and not issubclass(obj, (BaseException, enum.Enum)):
            checked_arguments(obj)
