"""Shared output of the benchmark scripts: aligned tables with units, a progress line,
`--json`, argument checks, the CSV file and matplotlib (when installed).

Every script prints the same way: a `#` line saying where and when it ran, then one or
more tables whose second header line gives each column's unit; progress goes to stderr,
so `--json` leaves exactly one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform
import re
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# -- timing ---------------------------------------------------------------------------


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


# -- units ------------------------------------------------------------------------------

GIB = 2**30
MIB = 2**20


def gib_per_s(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / GIB if seconds > 0 else math.nan


@dataclasses.dataclass(frozen=True)
class Col:
    """One table column: the row key, a short header, its unit and how to show a value.

    Units: "ms" and "µs" (the value is in seconds), "M/s" (the value is per second),
    "GiB/s", "MiB", "KiB", "x" (a ratio shown as
    1.23x), "%" (a fraction shown as +12.3%), "" (counts and names).
    """

    key: str
    header: str
    unit: str = ""
    digits: int = 2
    text: bool = False  # left-aligned names instead of right-aligned numbers

    def show(self, value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if isinstance(value, str):
            return value
        if self.unit == "ms":
            return f"{1e3 * value:.{self.digits}f}"
        if self.unit == "µs":
            return f"{1e6 * value:.{self.digits}f}"
        if self.unit == "M/s":
            return f"{value / 1e6:.{self.digits}f}"
        if self.unit == "x":
            return f"{value:.{self.digits}f}×"
        if self.unit == "%":
            return f"{100 * value:+.{max(self.digits - 1, 0)}f}%"
        if isinstance(value, int):
            return f"{value:,}"
        return f"{value:.{self.digits}f}"

    def parse(self, cell: str) -> Any:
        """The value `show` printed as `cell` (to the digits shown): what `--replot`
        reads back from a recorded table."""
        cell = cell.strip()
        if self.text:
            return cell
        if cell == "-":
            return math.nan
        scale = {"ms": 1e-3, "µs": 1e-6, "M/s": 1e6, "%": 1e-2}.get(self.unit, 1)
        cell = cell.rstrip("×%").replace(",", "")
        if scale == 1 and cell.lstrip("-").isdigit():
            return int(cell)
        return float(cell) * scale


def table(rows: Sequence[Mapping[str, Any]], cols: Sequence[Col], title: str = "") -> str:
    """Rows as an aligned text table: a header line, a unit line, then one line per row.

    Text columns (`Col(..., text=True)`) are left-aligned, numbers right-aligned.
    """
    cells = [[c.show(r.get(c.key)) for c in cols] for r in rows]
    heads = [c.header for c in cols]
    units = ["" if c.unit in ("x", "%") else c.unit for c in cols]  # values carry × and %
    columns = zip(heads, units, *cells, strict=True)
    widths = [max(len(v) for v in column) for column in columns]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.ljust(w) if c.text else v.rjust(w)
            for v, w, c in zip(values, widths, cols, strict=True)
        ]
        return "  ".join(parts).rstrip()

    out = [title] if title else []
    out += [line(heads), line(units), "  ".join("-" * w for w in widths)]
    out += [line(c) for c in cells]
    return "\n".join(out)


_BANNER = re.compile(
    r"^# (?P<name>\S+) benchmark: (?P<date>[^,]+), (?P<machine>\S+) (?P<cpus>\d+) CPUs"
    r"(?:, jax (?P<jax>\S+) on (?P<device>.+))?$"
)


def read_recorded(text: str, name: str) -> tuple[dict[str, Any], list[tuple[str, list[dict]]]]:
    """What a script printed (its `#` banner and tables, e.g. a run recorded in
    docs/benchmarks.md): (`machine()`-like info, [(title, rows of cell text by header)]).

    Columns are cut where the table's dashes line puts them (every cell fits its
    column's width), so names with spaces read back whole."""
    lines = text.splitlines()
    info: dict[str, Any] = {}
    for line in lines:
        m = _BANNER.match(line.strip())
        if m:
            info = {k: v for k, v in m.groupdict().items() if v is not None}
            break
    if info.get("name") != name:
        raise SystemExit(f"error: --replot: no '# {name} benchmark: ...' line in the file")
    info["cpus"] = int(info["cpus"])
    tables = []
    for i, line in enumerate(lines):
        if not line.strip() or set(line.replace(" ", "")) != {"-"} or i < 2:
            continue
        spans = [(m.start(), m.end()) for m in re.finditer(r"-+", line)]

        def cut(text: str, spans=spans) -> list[str]:
            return [text[a:b].strip() for a, b in spans]

        heads = cut(lines[i - 2])
        title = lines[i - 3].strip() if i >= 3 and not lines[i - 3].startswith("#") else ""
        rows = []
        for row in lines[i + 1 :]:
            if not row.strip():
                break
            rows.append(dict(zip(heads, cut(row.ljust(spans[-1][1])), strict=True)))
        tables.append((title, rows))
    if not tables:
        raise SystemExit(f"error: --replot: no table in the file (a '{name}' run's output)")
    return info, tables


def parse_rows(rows: Sequence[Mapping[str, str]], cols: Sequence[Col]) -> list[dict]:
    """Rows of cell text (by header, `read_recorded`) as values by key, for `cols`."""
    return [{c.key: c.parse(r[c.header]) for c in cols if c.header in r} for r in rows]


def add_replot_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replot", type=pathlib.Path, metavar="FILE",
        help="measure nothing: redraw the PNG from a recorded run (this script's printed "
        "output saved to FILE, e.g. a table of docs/benchmarks.md)",
    )  # fmt: skip


def log_axis(ax: Any, low: float, high: float, suffix: str = "") -> None:
    """A log y axis from `low` to `high` with readable ticks (0.1, 0.2, 0.5, 1, 2, ...)."""
    import matplotlib.ticker as mticker

    low, high = low / 1.4, high * 1.4
    ax.set_yscale("log")
    ax.set_ylim(low, high)
    steps = [m * 10.0**e for e in range(-3, 4) for m in (1, 2, 5)]
    ax.yaxis.set_major_locator(mticker.FixedLocator([t for t in steps if low <= t <= high]))
    ax.yaxis.set_major_formatter(mticker.FuncFormatter(lambda v, _: f"{v:g}{suffix}"))
    ax.yaxis.set_minor_formatter(mticker.NullFormatter())


def ratio_axis(ax: Any, low: float, high: float) -> None:
    """A log y axis of ratios from `low` to `high` (and 1), ticks as 0.5×, 1×, 2×."""
    log_axis(ax, min(low, 1), max(high, 1), "×")


def ratio_bars(ax: Any, at: Any, ratios: Sequence[float], width: float, **kw: Any) -> None:
    """Bars from 1× up (faster) or down (slower) to each ratio, its value written at the end."""
    ax.bar(at, [v - 1 for v in ratios], width, bottom=1, **kw)
    for xi, v in zip(at, ratios, strict=True):
        up = v >= 1
        ax.text(xi, v * (1.04 if up else 0.96), f"{v:.2f}×", ha="center",
                va="bottom" if up else "top", fontsize=7)  # fmt: skip


def measured_on(info: Mapping[str, Any]) -> str:
    """`2026-11-30, x86_64 2 CPUs, jax 0.10.2 on cpu`: what a plot says it was measured on."""
    where = f"{info['date']}, {info['machine']} {info['cpus']} CPUs"
    if "jax" in info:
        where += f", jax {info['jax']} on {info['device']}"
    return where


# -- progress ---------------------------------------------------------------------------


class Progress:
    """`[3/12] what... 14 s elapsed, about 30 s left` on stderr, one line per step.

    On a terminal the line is rewritten in place; in a log each step is its own line.
    Silent with `quiet`.
    """

    def __init__(self, total: int, *, quiet: bool = False, stream: Any = None) -> None:
        self.total, self.done, self.quiet = total, 0, quiet
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self._tty = getattr(self.stream, "isatty", lambda: False)()

    def step(self, what: str) -> None:
        """Announces the step about to run."""
        if self.quiet:
            return
        elapsed = time.perf_counter() - self.start
        left = ""
        if self.done:
            left = f", about {elapsed / self.done * (self.total - self.done):.0f} s left"
        text = f"[{self.done + 1}/{self.total}] {what} ({elapsed:.0f} s elapsed{left})"
        if self._tty:
            self.stream.write("\r\033[K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self.done += 1

    def finish(self) -> None:
        if self.quiet:
            return
        elapsed = time.perf_counter() - self.start
        end = "\r\033[K" if self._tty else ""
        self.stream.write(f"{end}{self.total} steps in {elapsed:.1f} s\n")
        self.stream.flush()


# -- arguments --------------------------------------------------------------------------


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low`, refused with the rule otherwise."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def add_output_args(parser: argparse.ArgumentParser, default_out: pathlib.Path) -> None:
    """`--json`, `--quiet` and `--out`, the same for every script."""
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document on stdout instead of tables"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=default_out,
        help=f"directory for the CSV and PNG (default {default_out})",
    )


def backend_problem(backend: str, interpret: bool = False) -> str | None:
    """Why kernel `backend` cannot run on this platform (one tiny gather tried), or None.

    Lets a script refuse `--backend triton` on a CPU with the library's own reason
    instead of dying in the middle of a sweep."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels as pk

    if backend == "auto":
        return None
    cache = [jnp.zeros((2, 256), jnp.uint32)]
    try:
        kw = {"layout": pk.KVLayout.raw(), "backend": backend, "interpret": interpret}
        jax.block_until_ready(pk.gather_blocks(cache, np.array([1], np.int32), **kw))
    except Exception as e:  # whatever the backend raises: reported, not a traceback
        first = str(e).splitlines()[0] if str(e) else ""
        return f"{type(e).__name__}: {first}"
    return None


# -- output -----------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """Where and when: date, host architecture and CPUs, Python, jax and device (if loaded)."""
    info: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    jax = sys.modules.get("jax")
    if jax is not None:
        info["jax"] = jax.__version__
        info["device"] = jax.devices()[0].device_kind
    return info


def banner(name: str, info: Mapping[str, Any], note: str = "") -> str:
    parts = [f"{info['date']}", f"{info['machine']} {info['cpus']} CPUs"]
    if "jax" in info:
        parts.append(f"jax {info['jax']} on {info['device']}")
    lines = [f"# {name} benchmark: " + ", ".join(parts)]
    for paragraph in note.split("\n"):  # a paragraph starts on its own `#` line
        lines += ["# " + line for line in textwrap.wrap(paragraph, 96)]
    return "\n".join(lines)


def emit(
    name: str,
    args: argparse.Namespace,
    tables: Sequence[tuple[str, Sequence[Mapping[str, Any]], Sequence[Col]]],
    rows: Sequence[Mapping[str, Any]],
    *,
    note: str = "",
    info: Mapping[str, Any] | None = None,
) -> None:
    """Prints the tables (or, with `--json`, one JSON document) on stdout.

    `tables` holds (title, rows, columns) triples; `rows` are the raw measurements (SI
    units: seconds, bytes, bytes per second; ratios as plain numbers), which is what the
    JSON document and the CSV file hold.
    """
    info = dict(info or machine())
    if args.json:
        doc = {"benchmark": name, **info, "note": note, "rows": [dict(r) for r in rows]}
        print(json.dumps(doc, indent=2, default=_json_default))
        return
    print(banner(name, info, note))
    for title, trows, cols in tables:
        print()
        print(table(trows, cols, title))


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def write_csv(path: pathlib.Path, cols: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(cols), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}", file=sys.stderr)  # stderr: `--json` keeps stdout to itself


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


def save(fig: Any, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", file=sys.stderr)
    import matplotlib.pyplot as plt

    plt.close(fig)


def report(
    out: pathlib.Path,
    name: str,
    cols: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    plot: Any,
) -> None:
    """Prints a plain table, writes `<out>/<name>.csv` and `plot(rows, <out>/<name>.png)`.

    Kept for scripts not yet on `emit` (their own tables); new code uses `emit`.
    """
    print(table(rows, [Col(c, c, digits=4) for c in cols]))
    write_csv(out / f"{name}.csv", cols, rows)
    plot(rows, out / f"{name}.png")
