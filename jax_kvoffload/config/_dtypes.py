"""Dtypes as the config model sees them: numpy dtypes (bf16 and fp8 from ml_dtypes).

Callers may pass a numpy/JAX dtype, a scalar type such as `jnp.bfloat16`, a torch dtype's
string form (`"torch.float16"`) or a name; names are case-sensitive like numpy's.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jax_kvoffload.config._errors import ConfigFieldError

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


def as_dtype(value: object, field: str = "dtype") -> np.dtype:
    """Returns `value` as a numpy dtype, or raises a `ConfigFieldError` naming `field`."""
    if isinstance(value, np.dtype):
        return value
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        name = _ALIASES.get(name, name)
        if name in _ML_DTYPES:
            return _ML_DTYPES[name]
        try:
            return np.dtype(name)
        except TypeError:
            raise ConfigFieldError(
                field,
                f"unknown dtype name {value!r}; use a numpy/JAX dtype or a name "
                f"such as 'bfloat16', 'float16', 'float8_e4m3fn', 'uint8'",
            ) from None
    if isinstance(value, type) or hasattr(value, "dtype"):
        try:
            return np.dtype(value)
        except TypeError:
            pass
    raise ConfigFieldError(field, f"expected a dtype or dtype name, got {value!r}")


def dtype_name(dtype: np.dtype) -> str:
    """The name vLLM writes for a dtype (`str(torch.bfloat16)` without 'torch.')."""
    return str(dtype)
