"""CRC32C (Castagnoli, iSCSI / RFC 3720) of tier payloads, fast where a C library is present.

Backends, first usable wins (`CRC32C_BACKEND` names the one chosen):

- ``google_crc32c`` (Apache-2.0, the ``[tiers]`` extra): hardware CRC instructions,
  measured 9-12 GB/s on one core of the development machine (AMD EPYC, 2 vCPU) for
  2-8 MiB buffers. It holds the GIL while it runs; at that speed a 2 MiB chunk costs
  ~0.2 ms, a tenth of reading it from an NVMe disk.
- ``crc32c`` (LGPL, used only when the user installed it): same speed, releases the GIL.
- ``numpy``: the fallback, always available. Lanes of the buffer are processed side by
  side (slicing-by-8 table lookups across lanes), then combined with GF(2) shift
  operators, as zlib's ``crc32_combine`` does. Exact, but 50-100x slower than the C
  backends; a warning is logged once when a tier starts on it.

Every backend returns the same value for the same bytes (tests compare them), so an
entry written on one machine verifies on another.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from jax_kvoffload._log_once import log_once
from jax_kvoffload.errors import KVOffloadTypeError, KVOffloadValueError

if TYPE_CHECKING:
    from jax_kvoffload.tiers._base import Buffer

__all__ = ["CRC32C_BACKEND", "crc32c", "crc32c_numpy", "crc32c_reference"]

logger = logging.getLogger(__name__)

_POLY = 0x82F63B78  # CRC32C, reflected.


def _byte_table() -> np.ndarray:
    table = np.zeros(256, dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        table[i] = c
    return table


_T0 = _byte_table()
_T0_LIST = [int(x) for x in _T0]


def _slice_tables(n: int) -> np.ndarray:
    # tables[k][b] = CRC register after byte b followed by k zero bytes (slicing-by-n).
    tables = np.zeros((n, 256), dtype=np.uint32)
    tables[0] = _T0
    for k in range(1, n):
        prev = tables[k - 1]
        tables[k] = (prev >> np.uint32(8)) ^ _T0[prev & np.uint32(0xFF)]
    return tables


_T8 = _slice_tables(8)


def crc32c_reference(data: Buffer, value: int = 0) -> int:
    """Bytewise CRC32C, the plain textbook loop (the oracle of the tests; slow)."""
    crc = value ^ 0xFFFFFFFF
    for b in memoryview(data).cast("B"):  # type: ignore[arg-type]
        crc = _T0_LIST[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# ---- numpy fallback ----------------------------------------------------------------------

# Operators are 32 uint32 columns: column i is the image of register bit i.


def _zero_byte_operator() -> np.ndarray:
    cols = np.zeros(32, dtype=np.uint32)
    for i in range(32):
        c = 1 << i
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        cols[i] = c
    return cols


def _apply(op: np.ndarray, v: np.ndarray) -> np.ndarray:
    out = np.zeros_like(v)
    for i in range(32):
        out ^= op[i] * ((v >> np.uint32(i)) & np.uint32(1))
    return out


def _compose(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # Operator "b, then a".
    return _apply(a, b.copy())


@functools.lru_cache(maxsize=64)
def _shift_operator(nbytes: int) -> np.ndarray:
    """The operator that feeds `nbytes` zero bytes through the CRC register."""
    result = np.array([1 << i for i in range(32)], dtype=np.uint32)  # identity
    power = _zero_byte_operator()
    n = nbytes
    while n:
        if n & 1:
            result = _compose(power, result)
        n >>= 1
        if n:
            power = _compose(power, power)
    return result


def _raw_lanes(words: np.ndarray) -> np.ndarray:
    """Zero-initialised CRC registers of each row of `words` ([lanes, steps] uint64)."""
    state = np.zeros(words.shape[0], dtype=np.uint64)
    mask = np.uint64(0xFF)
    t = _T8
    for j in range(words.shape[1]):
        x = state ^ words[:, j]
        s = t[7][x & mask]
        for k in range(1, 8):
            s ^= t[7 - k][(x >> np.uint64(8 * k)) & mask]
        state = s.astype(np.uint64)
    return state.astype(np.uint32)


_LANES = 4096  # measured: larger lane counts stop paying off on a 2 MiB buffer
_SMALL = 256  # below this, the bytewise loop is faster than setting up lanes


def crc32c_numpy(data: Buffer, value: int = 0) -> int:
    """CRC32C with numpy only: lanes in lockstep, then shift-and-xor combination."""
    buf = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)  # type: ignore[arg-type]
    if buf.size < _SMALL:
        return _bytewise(buf, value)
    # A power-of-two number of lanes of whole little-endian uint64 words; what is left
    # over (less than half the buffer) is processed by the same function again.
    lanes = 1 << (min(_LANES, buf.size // 8).bit_length() - 1)
    lane = 8 * (buf.size // (8 * lanes))
    body = lanes * lane
    regs = _raw_lanes(buf[:body].view("<u8").reshape(lanes, lane // 8))
    span = lane
    while regs.size > 1:  # crc(A || B) = shift_len(B)(crc(A)) ^ crc(B), zero-initialised
        regs = _apply(_shift_operator(span), regs[0::2]) ^ regs[1::2]
        span *= 2
    start = np.array([value ^ 0xFFFFFFFF], dtype=np.uint32)
    crc = int(regs[0]) ^ int(_apply(_shift_operator(body), start)[0])
    return crc32c_numpy(buf[body:], crc ^ 0xFFFFFFFF) if body < buf.size else crc ^ 0xFFFFFFFF


def _bytewise(buf: np.ndarray, value: int) -> int:
    crc = value ^ 0xFFFFFFFF
    for b in buf.tobytes():
        crc = _T0_LIST[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


# ---- backend choice ----------------------------------------------------------------------


def _pick() -> tuple[str, Callable[[Buffer, int], int]]:
    try:
        import google_crc32c

        if getattr(google_crc32c, "implementation", "") == "c":
            extend = google_crc32c.extend

            def _google(data: Buffer, value: int = 0) -> int:
                # Its C entry point takes only buffers without a release hook (bytes,
                # numpy arrays), not memoryviews: a numpy view costs nothing.
                if not isinstance(data, (bytes, np.ndarray)):
                    data = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
                crc: int = extend(value, data)
                return crc

            return "google_crc32c", _google
    except ImportError:
        pass
    try:
        import crc32c as _crc32c_pkg

        def _icrar(data: Buffer, value: int = 0) -> int:
            crc: int = _crc32c_pkg.crc32c(data, value)
            return crc

        return "crc32c", _icrar
    except ImportError:
        pass
    return "numpy", crc32c_numpy


CRC32C_BACKEND, _impl = _pick()


def crc32c(data: Buffer, value: int = 0) -> int:
    """CRC32C of the bytes of `data` (any contiguous buffer), continuing from `value`.

    `crc32c(b + c) == crc32c(c, crc32c(b))`; `crc32c(b"123456789") == 0xE3069283`.
    """
    if type(value) is not int or not 0 <= value <= 0xFFFFFFFF:
        _check_value(value)  # the backends would return a wrong CRC, silently
    try:
        return _impl(data, value)
    except TypeError:
        raise KVOffloadTypeError(
            "crc32c(data) takes a contiguous buffer (bytes, memoryview, numpy array), got "
            f"{type(data).__name__}"
        ) from None
    except (ValueError, BufferError) as e:  # e.g. a strided numpy view
        raise KVOffloadValueError(f"crc32c(data): {e}; pass a contiguous copy") from None


def _check_value(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVOffloadTypeError(f"crc32c value must be an int (a CRC), got {value!r:.40}")
    if not 0 <= value <= 0xFFFFFFFF:
        raise KVOffloadValueError(f"crc32c value must be in [0, 2**32), got {value}")


def warn_if_slow() -> None:
    """Logs that the numpy fallback is in use (tiers call this when they start): at
    WARNING for the first tier of the process."""
    if CRC32C_BACKEND == "numpy":
        log_once(
            logger,
            "crc32c-numpy",
            "CRC32C runs on the numpy fallback (about 100x slower than a C library); "
            "tier throughput will be CPU-bound. Install the C backend: "
            "pip install 'jax-kvoffload[tiers]' (google-crc32c).",
        )
