"""Dtypes as the config model sees them: numpy dtypes (bf16 and fp8 from ml_dtypes).

Callers may pass a numpy/JAX dtype, a scalar type such as `jnp.bfloat16`, a torch dtype's
string form (`"torch.float16"`) or a name; names are case-sensitive like numpy's.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jax_kvoffload.config._errors import ConfigFieldError, ConfigTypeError

# Short names used by vLLM's `cache_dtype` and by engines, mapped to numpy names.
_ALIASES = {
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "float": "float32",
    "fp32": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}

# Names numpy itself does not know (ml_dtypes registers the scalar types, not the names).
_ML_DTYPES = {
    name: np.dtype(getattr(ml_dtypes, name))
    for name in (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e4m3b11fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "int4",
        "uint4",
    )
    if hasattr(ml_dtypes, name)
}


# numpy kinds a KV cache can hold: floats and (un)signed integers. ml_dtypes' types
# (bfloat16, fp8, int4) are kind "V" and are listed in _ML_DTYPES instead.
_NUMERIC_KINDS = frozenset("fiu")
_EXAMPLES = "'bfloat16', 'float16', 'float32', 'float8_e4m3fn', 'int8' or 'uint8'"


def _checked(dtype: np.dtype, value: object, field: str) -> np.dtype:
    # object, complex, bool, str, datetime and struct dtypes are no KV cache element.
    if dtype.kind in _NUMERIC_KINDS or dtype in _ML_DTYPES.values():
        return dtype
    raise ConfigFieldError(
        field,
        f"{value!r} (numpy kind {dtype.kind!r}) is not a KV cache element type; use a "
        f"float or integer dtype such as {_EXAMPLES}",
    )


def as_dtype(value: object, field: str = "dtype") -> np.dtype:
    """Returns `value` as a numpy dtype, or raises a `ConfigFieldError` (an unknown or
    non-numeric dtype) or `ConfigTypeError` (not a dtype at all) naming `field`.

    Only float and integer types are dtypes here (bf16 and fp8 included); `object`,
    `complex64`, `bool` and the like are refused.
    """
    if isinstance(value, np.dtype):
        return _checked(value, value, field)
    if type(value).__module__ == "torch":  # a torch.dtype, without importing torch
        value = str(value)
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        name = _ALIASES.get(name, name)
        if name in _ML_DTYPES:
            return _ML_DTYPES[name]
        try:
            return _checked(np.dtype(name), value, field)
        except TypeError:
            raise ConfigFieldError(
                field,
                f"unknown dtype name {value!r}; use a numpy/JAX dtype or a name such as "
                f"{_EXAMPLES}",
            ) from None
    if isinstance(value, type) or hasattr(value, "dtype"):
        try:
            dtype = np.dtype(value)
        except TypeError:
            pass
        else:
            return _checked(dtype, value, field)
    raise ConfigTypeError(
        field, f"expected a dtype or a dtype name, got {type(value).__name__}; use {_EXAMPLES}"
    )


def dtype_name(dtype: np.dtype) -> str:
    """The name vLLM writes for a dtype (`str(torch.bfloat16)` without 'torch.')."""
    return str(dtype)
