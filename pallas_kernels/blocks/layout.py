"""KV cache layouts and the integer-word views the copy kernels move.

A layout is a small frozen description of one cache array (all arrays in ``caches``
share it). Kernels never see values: every array is reshaped and bitcast to
``[outer, num_blocks, words]`` of an unsigned integer word type, so any dtype (fp8,
bf16, int8, packed 4-bit in a raw page) moves bit-exactly. ``outer`` is 2 for K/V
stacked first (the page of a block is two strided halves) and 1 otherwise.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from .errors import LayoutError, LayoutMismatchError, UnsupportedDtypeError


class PageFormat(enum.Enum):
    """What one block's page holds, per cache array."""

    NHD = "NHD"  # [num_blocks, block_size, num_kv_heads, head_dim]
    HND = "HND"  # [num_blocks, num_kv_heads, block_size, head_dim]
    MLA = "MLA"  # [num_blocks, block_size, latent_dim]
    RAW = "RAW"  # [num_blocks, page_words]: uint8 bytes or wider integer words
    # ragged-paged-attention v3 (tpu-inference, sglang-jax, EasyDeL):
    # [num_blocks, block_size, kv_rows, packing, head_dim_padded], K/V alternating slots
    RPA = "RPA"


class KVStacking(enum.Enum):
    """Where K and V live relative to each other."""

    NONE = "none"  # one array per layer (MLA latent, raw page, or K-only)
    SEPARATE = "separate"  # caches = [k0, v0, k1, v1, ...]; each array has a plain page
    FIRST = "first"  # [2, num_blocks, ...]: vLLM flash-attention's shape
    SECOND = "second"  # [num_blocks, 2, ...]


_BASE_RANK = {
    PageFormat.NHD: 4,
    PageFormat.HND: 4,
    PageFormat.MLA: 3,
    PageFormat.RAW: 2,
    PageFormat.RPA: 5,
}
#: Formats whose page holds no separate V (or holds K and V merged in one axis).
_UNSTACKED = (PageFormat.MLA, PageFormat.RAW, PageFormat.RPA)
#: Lane width RPA v3 pads head_dim to.
RPA_LANES = 128
_WORD_DTYPES = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVLayout:
    """Layout of every array in ``caches``; hashable, so it is a jit static.

    Attributes:
      page_format: what one page holds (``PageFormat``).
      kv_stacking: how K and V are arranged (``KVStacking``); MLA and RAW pages have no
        separate V, so only ``NONE`` is allowed with them.
    """

    page_format: PageFormat = PageFormat.NHD
    kv_stacking: KVStacking = KVStacking.NONE

    def __post_init__(self) -> None:
        if not isinstance(self.page_format, PageFormat):
            raise TypeError(
                f"page_format must be a PageFormat, got {self.page_format!r}; "
                f"use one of {[f.name for f in PageFormat]}"
            )
        if not isinstance(self.kv_stacking, KVStacking):
            raise TypeError(
                f"kv_stacking must be a KVStacking, got {self.kv_stacking!r}; "
                f"use one of {[s.name for s in KVStacking]}"
            )
        if self.page_format in _UNSTACKED and self.kv_stacking is not KVStacking.NONE:
            why = (
                "K and V alternate in its slot axis"
                if self.page_format is PageFormat.RPA
                else ("it has no separate V")
            )
            raise LayoutError(
                f"kv_stacking={self.kv_stacking.name} is not allowed with "
                f"page_format={self.page_format.name}: {why}; use KVStacking.NONE"
            )

    @classmethod
    def nhd(cls, kv_stacking: KVStacking = KVStacking.NONE) -> KVLayout:
        return cls(page_format=PageFormat.NHD, kv_stacking=kv_stacking)

    @classmethod
    def hnd(cls, kv_stacking: KVStacking = KVStacking.NONE) -> KVLayout:
        return cls(page_format=PageFormat.HND, kv_stacking=kv_stacking)

    @classmethod
    def mla(cls) -> KVLayout:
        return cls(page_format=PageFormat.MLA)

    @classmethod
    def raw(cls) -> KVLayout:
        return cls(page_format=PageFormat.RAW)

    @classmethod
    def rpa(cls) -> KVLayout:
        """Ragged-paged-attention v3: ``[num_blocks, block_size, kv_rows, packing,
        head_dim]`` (``pallas_kernels.rpa_cache_shape``), one array per layer."""
        return cls(page_format=PageFormat.RPA)

    @property
    def name(self) -> str:
        """The layout's name in ``LAYOUT_NAMES`` (``named_layout`` is the inverse)."""
        base = self.page_format.value.lower()
        if self.kv_stacking is KVStacking.NONE:
            return base
        return f"{base}_{self.kv_stacking.value}"

    @property
    def rank(self) -> int:
        stacked = self.kv_stacking in (KVStacking.FIRST, KVStacking.SECOND)
        return _BASE_RANK[self.page_format] + int(stacked)

    @property
    def block_axis(self) -> int:
        return 1 if self.kv_stacking is KVStacking.FIRST else 0

    def describe(self) -> str:
        names = {
            PageFormat.NHD: "block_size, num_kv_heads, head_dim",
            PageFormat.HND: "num_kv_heads, block_size, head_dim",
            PageFormat.MLA: "block_size, latent_dim",
            PageFormat.RAW: "page_words",
            PageFormat.RPA: "block_size, kv_rows, packing, head_dim",
        }[self.page_format]
        if self.kv_stacking is KVStacking.FIRST:
            return f"[2, num_blocks, {names}]"
        if self.kv_stacking is KVStacking.SECOND:
            return f"[num_blocks, 2, {names}]"
        return f"[num_blocks, {names}]"

    def num_blocks(self, shape: tuple[int, ...]) -> int:
        return shape[self.block_axis]

    def page_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of one block's page in one array (the block axis removed)."""
        axis = self.block_axis
        return tuple(shape[:axis]) + tuple(shape[axis + 1 :])

    def check_cache(self, shape: tuple[int, ...], dtype: np.dtype, *, name: str) -> None:
        """Raises a typed error unless ``shape``/``dtype`` fit this layout."""
        # Every gather and scatter checks its caches; a geometry that passed once passes
        # again (a raise is not remembered), and the RPA checks cost a few µs per call.
        try:
            key = (tuple(shape), np.dtype(dtype))
            hash(key)
        except TypeError:  # not a shape or dtype: the checks below name what is wrong
            self._check_cache(shape, dtype, name)
            return
        _checked(self, *key, name)

    def _check_cache(self, shape: tuple[int, ...], dtype: np.dtype, name: str) -> None:
        if len(shape) != self.rank:
            raise LayoutMismatchError(
                f"{name} has shape {tuple(shape)} (rank {len(shape)}), but layout "
                f"{self.page_format.name}/kv_stacking={self.kv_stacking.name} needs rank "
                f"{self.rank}: {self.describe()}; pass the layout that matches the array"
            )
        if self.kv_stacking is KVStacking.FIRST and shape[0] != 2:
            raise LayoutMismatchError(
                f"{name} has shape {tuple(shape)}; kv_stacking=FIRST needs axis 0 of size 2 "
                f"(K, V): {self.describe()}"
            )
        if self.kv_stacking is KVStacking.SECOND and shape[1] != 2:
            raise LayoutMismatchError(
                f"{name} has shape {tuple(shape)}; kv_stacking=SECOND needs axis 1 of size 2 "
                f"(K, V): {self.describe()}"
            )
        if 0 in self.page_shape(shape):
            raise LayoutMismatchError(
                f"{name} has shape {tuple(shape)}: its pages {self.page_shape(shape)} hold no "
                f"element; every axis but the block axis ({self.block_axis}) must be >= 1"
            )
        dt = np.dtype(dtype)
        if dt == np.bool_ or dt.kind == "c" or dt.itemsize not in _WORD_DTYPES:
            raise UnsupportedDtypeError(
                f"{name} has dtype {dt.name}; the copy kernels move 1-, 2- or 4-byte elements "
                "(bf16, fp16, fp32, fp8, int8, uint8, int32, ...); view packed or other data "
                "as KVLayout.raw() with uint8 or uint32 words"
            )
        if self.page_format is PageFormat.RPA:
            _check_rpa(tuple(shape), dt, name)
        if self.page_format is PageFormat.RAW and dt.kind not in "ui":
            raise UnsupportedDtypeError(
                f"{name} has dtype {dt.name}; a RAW page view holds integer words (uint8, "
                "uint16, uint32, ...); bitcast it first, e.g. "
                "jax.lax.bitcast_convert_type(cache, jnp.uint16)"
            )


@functools.lru_cache(maxsize=512)
def _checked(layout: KVLayout, shape: tuple[int, ...], dtype: np.dtype, name: str) -> None:
    layout._check_cache(shape, dtype, name)


def check_rpa_dtype(dtype: npt.DTypeLike) -> None:
    """Raises ``UnsupportedDtypeError`` for sub-byte types (int4, uint4, fp4): numpy
    holds one per byte, an engine packs ``32 // 4 = 8`` per word, so neither the packing
    axis nor the bytes of a page would be the engine's."""
    bits = jax.dtypes.itemsize_bits(np.dtype(dtype))
    if bits < 8:
        raise UnsupportedDtypeError(
            f"dtype {np.dtype(dtype).name} has {bits} bits; the RPA layout here packs 8-, "
            "16- or 32-bit elements (an engine packs 32 // 4 = 8 sub-byte slots per word, "
            "numpy one per byte); store such caches as KVLayout.raw() uint32 words"
        )


def _check_rpa(shape: tuple[int, ...], dt: np.dtype, name: str) -> None:
    check_rpa_dtype(dt)
    packing = 4 // dt.itemsize
    if shape[3] != packing:
        raise LayoutMismatchError(
            f"{name} has shape {shape} and dtype {dt.name}; the RPA layout packs "
            f"32 // {8 * dt.itemsize} = {packing} slots per word, so axis 3 (packing) must "
            f"be {packing}: build it with pallas_kernels.rpa_cache_shape(...)"
        )
    if shape[4] % RPA_LANES:
        raise LayoutMismatchError(
            f"{name} has shape {shape}: the RPA layout pads head_dim to a multiple of "
            f"{RPA_LANES} (axis 4 is {shape[4]}); build it with "
            "pallas_kernels.rpa_cache_shape(...)"
        )


def _all_layouts() -> dict[str, KVLayout]:
    out = {}
    for fmt in PageFormat:
        for stacking in KVStacking:
            if fmt in _UNSTACKED and stacking is not KVStacking.NONE:
                continue
            layout = KVLayout(page_format=fmt, kv_stacking=stacking)
            out[layout.name] = layout
    return out


_LAYOUTS = _all_layouts()
#: Every layout's name: "nhd", "nhd_first", "hnd_second", "mla", "raw", "rpa", ...
LAYOUT_NAMES: tuple[str, ...] = tuple(_LAYOUTS)


def named_layout(name: str) -> KVLayout:
    """The ``KVLayout`` called ``name`` (``LAYOUT_NAMES``; case-insensitive)."""
    if not isinstance(name, str) or name.lower() not in _LAYOUTS:
        raise LayoutError(
            f"layout name {name!r} is not one of {list(LAYOUT_NAMES)}; e.g. 'rpa' for the "
            "ragged-paged-attention v3 cache, 'nhd_second' for [num_blocks, 2, bs, H, D]"
        )
    return _LAYOUTS[name.lower()]


def page_bytes(shape: tuple[int, ...], dtype: np.dtype, layout: KVLayout) -> int:
    """Bytes of one block's page in one array."""
    return math.prod(layout.page_shape(shape)) * np.dtype(dtype).itemsize


def default_word_bytes(shape: tuple[int, ...], dtype: np.dtype, layout: KVLayout) -> int:
    """Widest word (<= 4 bytes) that divides a page half: fewer, wider moves per page."""
    outer = 2 if layout.kv_stacking is KVStacking.FIRST else 1
    half = page_bytes(shape, dtype, layout) // outer
    itemsize = np.dtype(dtype).itemsize
    for w in (4, 2, 1):
        if w >= itemsize and half % w == 0:
            return w
    raise AssertionError("unreachable: itemsize always divides the page")


def word_dtype(dtype: np.dtype, word_bytes: int) -> np.dtype:
    """The integer type words of ``word_bytes`` take for a cache of ``dtype``: the dtype
    itself when it already is an integer of that width, else the unsigned one."""
    dt = np.dtype(dtype)
    if dt.kind in "ui" and dt.itemsize == word_bytes:
        return dt
    word: np.dtype = np.dtype(_WORD_DTYPES[word_bytes])
    return word


def _as(x: jax.Array, dtype: np.dtype) -> jax.Array:
    # A bitcast to the same dtype is skipped, not emitted: on XLA:CPU any bitcast of a
    # scatter's operand costs a pass over the whole cache (measured: ~0.1 s per 256 MiB).
    return x if np.dtype(x.dtype) == np.dtype(dtype) else jax.lax.bitcast_convert_type(x, dtype)


def as_dtype(x: jax.Array, dtype: np.dtype) -> jax.Array:
    """``x`` bitcast to ``dtype`` of the same width (no op when it already is)."""
    return _as(x, dtype)


def is_integer(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind in "ui"


def as_bits(x: jax.Array) -> jax.Array:
    """``x`` as same-width integers (integer arrays are returned as they are)."""
    return _as(x, word_dtype(x.dtype, np.dtype(x.dtype).itemsize))


def fenced(words: jax.Array, zero: jax.Array | None) -> jax.Array:
    """``words ^ zero``, where ``zero`` is a run-time 0 (a jit argument), or ``words``.

    Why: XLA:CPU lowers a bf16 element that is loaded and stored unchanged to LLVM
    ``load bfloat`` / ``store bfloat``, which x86 legalizes through f32: subnormals flush
    (0x807F -> 0x8000) and NaNs quiet (0x7F81 -> 0x7FC1). The bitcasts to and from
    integers do not stop it: LLVM folds a bitcast pair inside one fused loop, and XLA
    folds them itself around the broadcasts it makes of one-block or repeated-id gathers
    (issue 12). An xor with a value neither XLA nor LLVM can see is the one operation
    that keeps every element an integer from load to store, and it is fused into the
    copy (a 64-page gather from a 256 MiB bf16 cache: 0.4-0.8 ms fenced, 0.6-4 ms
    before, on the noisy 2-core machine). An optimization barrier does not help: XLA
    removes it before fusion.
    """
    if zero is None:
        return words
    return jax.lax.bitwise_xor(words, zero.astype(words.dtype))


def to_words(cache: jax.Array, layout: KVLayout, word_bytes: int) -> jax.Array:
    """``cache`` as ``[outer, num_blocks, words]`` integer words (reshape + bitcast only)."""
    # Integers before any reshape: a reshape that moves data (e.g. of a sharded array)
    # may otherwise run on floats, and XLA:CPU canonicalises bf16 NaN payloads on the way
    # (0x7F81 -> 0x7FC0), breaking bit-exactness.
    itemsize = np.dtype(cache.dtype).itemsize
    cache = _as(cache, word_dtype(cache.dtype, itemsize))
    if layout.kv_stacking is KVStacking.FIRST:
        flat = cache.reshape(2, cache.shape[1], -1)
    else:
        flat = cache.reshape(1, cache.shape[0], -1)
    return bitcast_last(flat, word_bytes)


def bitcast_last(x: jax.Array, word_bytes: int) -> jax.Array:
    """``[..., E]`` of any 1/2/4-byte dtype as ``[..., E * itemsize / word_bytes]`` words."""
    itemsize = np.dtype(x.dtype).itemsize
    word = word_dtype(x.dtype, word_bytes)
    if word_bytes == itemsize:
        return _as(x, word)
    if word_bytes < itemsize:  # each element splits into itemsize/word_bytes words
        return jax.lax.bitcast_convert_type(x, word).reshape(*x.shape[:-1], -1)
    grouped = x.reshape(*x.shape[:-1], -1, word_bytes // itemsize)
    return jax.lax.bitcast_convert_type(grouped, word)


def from_words(words: jax.Array, shape: tuple[int, ...], dtype: np.dtype) -> jax.Array:
    """Inverse of ``to_words`` for any leading shape: reshape as integers, bitcast last."""
    itemsize = np.dtype(dtype).itemsize
    ratio = itemsize // np.dtype(words.dtype).itemsize
    if ratio > 1:  # narrower words: regroup them into whole elements first
        words = words.reshape(*words.shape[:-1], -1, ratio)
    values = _as(words, word_dtype(dtype, itemsize)).reshape(shape)
    # Same width, elementwise: the only step that sees the real dtype moves no data.
    return _as(values, dtype)
