"""Shared output of the benchmark scripts: the CSV file and matplotlib, when installed."""

from __future__ import annotations

import csv
import pathlib
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any


def median(fn: Any, repeats: int, *, warmup: bool = False) -> float:
    """Median wall seconds of `repeats` calls of `fn` (after one untimed call if `warmup`)."""
    if warmup:
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def write_csv(path: pathlib.Path, cols: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(cols), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


def pyplot() -> Any | None:
    """`matplotlib.pyplot` on the Agg backend, or None (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return None
    return plt


def report(
    out: pathlib.Path,
    name: str,
    cols: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    plot: Any,
) -> None:
    """Prints the table, writes `<out>/<name>.csv` and `plot(rows, <out>/<name>.png)`."""
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    write_csv(out / f"{name}.csv", cols, rows)
    plot(rows, out / f"{name}.png")
