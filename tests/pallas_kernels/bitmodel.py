"""A plain numpy model of what gather / scatter do to the bits, and random cases for it.

Everything here works on unsigned integer views (``np.uint8/16/32``): numpy never touches
the values, so the model is trivially right for NaN payloads, subnormals and -0.0. Cases
are drawn from the whole input space (tiny and odd shapes, one-block caches, repeated
ids, every layout and dtype), not through the library's own constructors.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np

import pallas_kernels as pk

DTYPES = {
    "bf16": ml_dtypes.bfloat16,
    "fp16": np.float16,
    "fp32": np.float32,
    "fp8_e4m3": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
    "int8": np.int8,
    "uint8": np.uint8,
    "uint16": np.uint16,
    "int32": np.int32,
}
INT_DTYPES = ("int8", "uint8", "uint16", "int32")  # the only ones a RAW page may hold
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}

# Bit patterns that a float conversion would change: subnormals (flushed to zero by
# FTZ/DAZ), signalling NaNs and NaN payloads (quieted or canonicalised), -0.0.
SPECIAL = {
    "bf16": [0x0001, 0x007F, 0x807F, 0x8001, 0x7F81, 0xFF81, 0x7FBF, 0x7FC1, 0xFFC1, 0x8000],
    "fp16": [0x0001, 0x03FF, 0x83FF, 0x8001, 0x7C01, 0xFC01, 0x7E01, 0x7DFF, 0x8000],
    "fp32": [0x00000001, 0x807FFFFF, 0x80000001, 0x7F800001, 0xFF800001, 0x7FBFFFFF,
             0x7FC00001, 0xFFC12345, 0x80000000],
    "fp8_e4m3": [0x01, 0x07, 0x81, 0x87, 0x7F, 0xFF, 0x80],
    "fp8_e5m2": [0x01, 0x03, 0x81, 0x83, 0x7D, 0x7E, 0x7F, 0xFD, 0x80],
}  # fmt: skip
# Bit patterns that a float conversion would change: subnormals (flushed to zero by
# FTZ/DAZ), signalling NaNs and NaN payloads (quieted or canonicalised), -0.0. Integer
# dtypes take the same bytes: any pattern is a plain value there.
SPECIAL |= {"int8": SPECIAL["fp8_e5m2"], "uint8": SPECIAL["fp8_e4m3"]}
SPECIAL |= {"uint16": SPECIAL["bf16"], "int32": SPECIAL["fp32"]}

LAYOUTS = {
    "nhd": pk.KVLayout.nhd(),
    "hnd": pk.KVLayout.hnd(),
    "nhd_first": pk.KVLayout.nhd(pk.KVStacking.FIRST),
    "hnd_first": pk.KVLayout.hnd(pk.KVStacking.FIRST),
    "nhd_second": pk.KVLayout.nhd(pk.KVStacking.SECOND),
    "hnd_second": pk.KVLayout.hnd(pk.KVStacking.SECOND),
    "nhd_separate": pk.KVLayout.nhd(pk.KVStacking.SEPARATE),
    "mla": pk.KVLayout.mla(),
    "raw": pk.KVLayout.raw(),
}


@dataclasses.dataclass(frozen=True)
class BitCase:
    """One call's inputs as raw bits: ``caches`` are unsigned-integer numpy arrays."""

    layout: str
    dtype: str
    shape: tuple[int, ...]
    caches: tuple[np.ndarray, ...]
    gather_ids: np.ndarray  # may repeat
    scatter_ids: np.ndarray  # unique
    update: np.ndarray  # staging bits for the scatter
    word_bytes: int | None

    def __repr__(self) -> str:
        return (
            f"BitCase({self.layout}, {self.dtype}, shape={self.shape}, L={len(self.caches)}, "
            f"gather_ids={self.gather_ids.tolist()}, scatter_ids={self.scatter_ids.tolist()}, "
            f"word_bytes={self.word_bytes})"
        )

    @property
    def kv_layout(self) -> pk.KVLayout:
        return LAYOUTS[self.layout]

    def arrays(self) -> list:
        """The caches as jax arrays of the real dtype (a host-to-device copy moves bytes)."""
        return [jnp.asarray(c.view(DTYPES[self.dtype])) for c in self.caches]

    def update_array(self):
        return jnp.asarray(self.update.view(DTYPES[self.dtype]))


def bits_of(x) -> np.ndarray:
    a = np.asarray(x)
    return a.view(UINT[a.dtype.itemsize])


def model_gather(caches, ids, block_axis: int) -> np.ndarray:
    """``[n, L, *page]``: entry i holds every array's page ``ids[i]``."""
    pages = [np.moveaxis(np.take(c, ids, axis=block_axis), block_axis, 0) for c in caches]
    return np.stack(pages, axis=1)


def model_scatter(caches, ids, update, block_axis: int) -> list[np.ndarray]:
    out = []
    for layer, cache in enumerate(caches):
        new = cache.copy()
        index = (slice(None),) * block_axis + (ids,)
        new[index] = np.moveaxis(update[:, layer], 0, block_axis)
        out.append(new)
    return out


def _shape(layout: str, nb: int, bs: int, h: int, d: int) -> tuple[int, ...]:
    return {
        "nhd": (nb, bs, h, d),
        "hnd": (nb, h, bs, d),
        "nhd_first": (2, nb, bs, h, d),
        "hnd_first": (2, nb, h, bs, d),
        "nhd_second": (nb, 2, bs, h, d),
        "hnd_second": (nb, 2, h, bs, d),
        "nhd_separate": (nb, bs, h, d),
        "mla": (nb, bs, d),
        "raw": (nb, bs * d),
    }[layout]


def random_bits(rng: np.random.Generator, shape, dtype: str) -> np.ndarray:
    """Three quarters special patterns of ``dtype``, the rest uniform bits."""
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    uint = UINT[itemsize]
    size = int(np.prod(shape))
    special = rng.choice(np.array(SPECIAL[dtype], dtype=uint), size=size)
    uniform = rng.integers(0, 2 ** (8 * itemsize), size=size, dtype=np.uint64).astype(uint)
    return np.where(rng.random(size) < 0.75, special, uniform).reshape(shape)


def _valid_words(shape, layout: str, itemsize: int) -> list[int]:
    lay = LAYOUTS[layout]
    outer = 2 if lay.kv_stacking is pk.KVStacking.FIRST else 1
    half = int(np.prod(lay.page_shape(shape))) * itemsize // outer
    return [w for w in (1, 2, 4) if half % w == 0]


def draw_case(
    rng: np.random.Generator,
    *,
    layout: str | None = None,
    dtype: str | None = None,
    max_blocks: int = 5,
    hazard: bool = False,
) -> BitCase:
    """A random case: small, often degenerate geometry (one block, one element).

    ``hazard``: always the shapes where XLA:CPU once changed bf16 bits (issue 12): one
    or two blocks, pages of 1-4 elements, one id repeated, words of the element width.
    """
    layout = layout or str(rng.choice(list(LAYOUTS)))
    if dtype is None and layout == "raw":
        dtype = str(rng.choice(INT_DTYPES))
    elif dtype is None:  # bf16 most: XLA:CPU computes bf16 through f32
        weights = np.array([4.0 if d == "bf16" else 1.0 for d in DTYPES])
        dtype = str(rng.choice(list(DTYPES), p=weights / weights.sum()))
    # Degenerate sizes on purpose: XLA rewrites gathers from one-block caches and of tiny
    # pages into broadcasts and scalar loops, where bits once changed (issue 12). Half
    # the cases are tiny (1-2 blocks, 1-4 element pages), the rest small but varied.
    if hazard or rng.random() < 0.5:
        nb = int(rng.integers(1, 3))
        bs, h, d = (int(rng.choice(v)) for v in ((1, 2), (1, 2), (1, 2, 3)))
    else:
        nb = int(rng.integers(1, max_blocks + 1))
        bs, h, d = (int(rng.choice(v)) for v in ((1, 2, 3, 4, 8), (1, 2, 3), (1, 2, 3, 8)))
    shape = _shape(layout, nb, bs, h, d)
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    num_arrays = int(rng.choice((2, 4) if layout == "nhd_separate" else (1, 2, 3)))
    caches = tuple(random_bits(rng, shape, dtype) for _ in range(num_arrays))
    kind = rng.random()
    n = int(rng.integers(0, 7))
    if hazard or kind < 0.35:  # one block over and over: a broadcast once XLA has simplified it
        gather_ids = np.full(max(n, 1), rng.integers(nb), np.int32)
    elif kind < 0.5:
        gather_ids = np.arange(nb, dtype=np.int32)
    else:
        gather_ids = rng.integers(0, nb, size=n).astype(np.int32)
    scatter_ids = rng.permutation(nb)[: int(rng.integers(0, nb + 1))].astype(np.int32)
    page = LAYOUTS[layout].page_shape(shape)
    update = random_bits(rng, (len(scatter_ids), num_arrays, *page), dtype)
    words = [None, *_valid_words(shape, layout, itemsize)]
    word_bytes = None if hazard else words[int(rng.integers(len(words)))]
    return BitCase(layout, dtype, shape, caches, gather_ids, scatter_ids, update, word_bytes)


def case_from(layout, dtype, shape, caches, gather_ids, scatter_ids=None) -> BitCase:
    """A hand-written case (the defects reported in issue 12)."""
    lay = LAYOUTS[layout]
    if scatter_ids is None:  # scatter ids must be unique
        scatter_ids = np.unique(np.asarray(gather_ids))
    scatter_ids = np.asarray(scatter_ids, np.int32)
    update = random_bits(
        np.random.default_rng(0),
        (len(scatter_ids), len(caches), *lay.page_shape(shape)),
        dtype,
    )
    return BitCase(
        layout,
        dtype,
        tuple(shape),
        tuple(caches),
        np.asarray(gather_ids, np.int32),
        scatter_ids,
        update,
        None,
    )
