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
_ML_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(getattr(ml_dtypes, name))
    for name in (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e4m3b11fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
    )
    if hasattr(ml_dtypes, name)
}

# Sub-byte types: the kernels, DLPack and the host pools move whole bytes, and XLA packs
# these two or more to a byte on some backends and not on others; engines keep packed
# 4-bit caches as uint8 words (vLLM's int4_per_token_head, nvfp4 modes do the same).
_SUB_BYTE = {"int2": 2, "uint2": 2, "int4": 4, "uint4": 4, "float4_e2m1fn": 4,
             "float6_e2m3fn": 6, "float6_e3m2fn": 6}  # fmt: skip


def sub_byte_bits(dtype: object) -> int | None:
    """Bits per element of a sub-byte dtype (int4: 4), None for whole-byte ones."""
    try:
        return _SUB_BYTE.get(np.dtype(dtype).name)  # type: ignore[call-overload]
    except TypeError:
        return None


def _sub_byte(name: str, value: object, field: str) -> ConfigFieldError:
    return ConfigFieldError(
        field,
        f"{value!r} is a sub-byte dtype ({_SUB_BYTE[name]} bits), which the kernels cannot "
        "move (they move whole bytes); keep the packed values in uint8 words and pass "
        "'uint8' (or a packed cache_dtype such as 'int4_per_token_head')",
    )


# numpy kinds a KV cache can hold: floats and (un)signed integers. ml_dtypes' types
# (bfloat16, fp8) are kind "V" and are listed in _ML_DTYPES instead.
_NUMERIC_KINDS = frozenset("fiu")
_EXAMPLES = "'bfloat16', 'float16', 'float32', 'float8_e4m3fn', 'int8' or 'uint8'"


def _checked(dtype: np.dtype, value: object, field: str) -> np.dtype:
    # object, complex, bool, str, datetime and struct dtypes are no KV cache element.
    if dtype.name in _SUB_BYTE:
        raise _sub_byte(dtype.name, value, field)
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
        if name in _SUB_BYTE:
            raise _sub_byte(name, value, field)
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
