"""What the tier benchmark's parts share: test data, keys and the rows they report.

Every row has the same fields (`ROW_FIELDS`, the CSV's columns and the JSON document's
rows), in SI units: bytes, seconds, GB/s = 10^9 bytes per second (the unit of the
recorded tables in docs/tiers.md and docs/benchmarks.md). `kind` says what a row is:

- "tier": a tier operation against its baseline (ratio and target filled in),
- "baseline": the medium alone (sequential file, bare files per chunk),
- "client": a Redis client on one connection (`--clients`),
- "checksum": a CRC32C backend.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

MiB = 1 << 20
GB = 1e9
NS = bytes(range(32))  # the namespace digest the benchmark's tiers use
ROW_FIELDS = (
    "kind",
    "tier",
    "op",
    "bytes",
    "seconds",
    "GBps",
    "baseline",
    "baseline_s",
    "baseline_GBps",
    "ratio",
    "target",
    "target_met",
)


def rows_buffer(n: int, size: int) -> tuple[mmap.mmap, np.ndarray]:
    """`n` page-aligned rows of `size` random bytes (as vLLM's and our shared host rows)."""
    m = mmap.mmap(-1, n * size)
    a = np.frombuffer(m, dtype=np.uint8).reshape(n, size)
    a[:] = np.random.default_rng(0).integers(0, 256, a.shape, dtype=np.uint8)
    return m, a


def keys(n: int, salt: bytes = b"") -> list[bytes]:
    """`n` fresh 36-byte offload keys (random hash, a 4-byte salt, group 0)."""
    return [os.urandom(28) + salt.ljust(4, b"\0")[:4] + (0).to_bytes(4, "big") for _ in range(n)]


def tier_row(
    tier: str, op: str, nbytes: int, tier_s: float, base: str, base_s: float, target: float
) -> dict:
    """A tier operation against its baseline: the same bytes, medians of the same run."""
    t, b = nbytes / tier_s / GB, nbytes / base_s / GB
    return {
        "kind": "tier",
        "tier": tier,
        "op": op,
        "bytes": nbytes,
        "seconds": tier_s,
        "GBps": t,
        "baseline": base,
        "baseline_s": base_s,
        "baseline_GBps": b,
        "ratio": t / b,
        "target": target,
        "target_met": None,  # decided with the CRC32C backend known (tiers.py)
    }


def info_row(kind: str, tier: str, op: str, nbytes: int, seconds: float) -> dict:
    """A measurement without a ratio: a baseline alone, a client, a checksum."""
    return {
        **dict.fromkeys(ROW_FIELDS),
        "kind": kind,
        "tier": tier,
        "op": op,
        "bytes": nbytes,
        "seconds": seconds,
        "GBps": nbytes / seconds / GB,
    }
