"""Secondary-tier throughput against what the medium itself does, measured in one run.

Disk (benchmarks/_tiers_disk.py): `DiskTier` stores and cold loads against a sequential
write + fsync and a cold read of the same bytes as one file in the same directory
(the faster of buffered and O_DIRECT; target >= 0.8). Redis (benchmarks/_tiers_redis.py):
`RedisTier` against `redis-benchmark` SET / GET at the same value size, connections and
pipeline depth, on the same server (one started here on a free loopback port, or
`--redis-url` of a scratch server; target >= 0.7). Redis Cluster (`--cluster`,
benchmarks/_tiers_cluster.py): the tier on a 3-primary loopback cluster against
`redis-benchmark --cluster` (target >= 0.7), and 3 primaries against 1. Mooncake
(`--mooncake`, benchmarks/_tiers_mooncake.py): `MooncakeTier` against Mooncake's own
`batch_put_from` / `batch_get_into` of the same rows through the same master (a private
loopback store; target >= 0.8). Medians of
`--repeats` alternating runs; GB/s = 10^9 bytes/s. Method and recorded numbers:
docs/tiers.md "Performance".

The tiers checksum every payload: on the numpy CRC32C fallback (no google-crc32c) the
checksum, not the tier, bounds the ratios, so the targets do not apply; the output says
so (header, table, `targets_apply: false` in the JSON).

Usage:
  python benchmarks/tiers.py --quick      # small sizes, seconds
  python benchmarks/tiers.py              # 512 MiB per disk pass, 256 MiB per Redis pass
  python benchmarks/tiers.py --cluster    # and the Redis Cluster part
  python benchmarks/tiers.py --mooncake   # and the Mooncake Store part
  python benchmarks/tiers.py --json       # one JSON document on stdout
  python benchmarks/tiers.py --out DIR    # CSV + PNG (default benchmarks/results/)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import shutil
import sys
import tempfile
import textwrap

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _report, _tiers_*
import _report
import _tiers_cluster
import _tiers_disk
import _tiers_mooncake
import _tiers_redis
from _tiers_common import ROW_FIELDS, MiB, info_row

from jax_kvoffload.config import TierConfigError
from jax_kvoffload.tiers import RedisTierConfig, _crc

FALLBACK_WARNING = (
    "WARNING: CRC32C: numpy fallback (~50-100x slower than google-crc32c): the checksum, "
    "not the tier, bounds these ratios, so they are not the tier's and the targets do not "
    "apply. For the tier's numbers: pip install -e '.[tiers]'"
)


def crc_backend() -> str:
    """The CRC32C backend the tiers use now (read at call time: tests replace it)."""
    return _crc.CRC32C_BACKEND


def targets_apply(backend: str) -> bool:
    """Whether the tier ratios are the tier's: not on the numpy fallback (a C backend,
    google_crc32c or crc32c, checksums at 10+ GB/s; numpy at ~0.1-0.2 GB/s)."""
    return backend != "numpy"


def bench_crc(out_rows: list[dict]) -> None:
    """The CRC32C backend in use, and the numpy fallback beside it, on 8 MiB."""
    data = np.frombuffer(os.urandom(8 * MiB), dtype=np.uint8)
    backend = crc_backend()
    backends = [(backend, _crc.crc32c)]
    if backend != "numpy":
        backends.append(("numpy fallback", _crc.crc32c_numpy))
    for name, fn in backends:
        secs = _report.median(lambda fn=fn: fn(data), 3, warmup=True)
        op = "checksum (in use)" if name == backend else "checksum"
        out_rows.append(info_row("checksum", f"CRC32C {name}", op, data.size, secs))


# -- output ---------------------------------------------------------------------------

Col = _report.Col
TIER_COLS = (
    Col("tier", "tier", text=True),
    Col("op", "operation", text=True),
    Col("mib", "size", "MiB", 1),
    Col("GBps", "tier", "GB/s"),
    Col("baseline", "baseline", text=True),
    Col("baseline_GBps", "baseline", "GB/s"),
    Col("ratio", "ratio", "x"),
    Col("target_text", "target", text=True),
    Col("met_text", "met", text=True),
)
OTHER_COLS = (
    Col("tier", "measured", text=True),
    Col("op", "operation", text=True),
    Col("mib", "size", "MiB", 1),
    Col("GBps", "rate", "GB/s"),
)


def judge(rows: list[dict], backend: str) -> None:
    """Fills `target_met` of the tier rows: whether the ratio reaches the target, or
    None where the targets do not apply (numpy CRC32C)."""
    applies = targets_apply(backend)
    for r in rows:
        if r["kind"] == "tier" and r["target"] is not None:  # a scaling ratio has none
            r["target_met"] = bool(r["ratio"] >= r["target"]) if applies else None


def shown(r: dict) -> dict:
    """A row as the tables show it (MiB, the target as a rule, met as yes / NO / n/a)."""
    met = {True: "yes", False: "NO", None: "n/a (numpy CRC32C)"}[r["target_met"]]
    if r["target"] is None:
        met = "(no target)"
    target = f">= {r['target']:g}" if r["target"] is not None else ""
    return {**r, "mib": r["bytes"] / MiB, "target_text": target, "met_text": met}


def note_for(args: argparse.Namespace, backend: str, mode: str | None, skipped: str) -> str:
    """The `#` header below the first line; its first paragraph names the CRC32C backend
    (and warns on the numpy fallback)."""
    first = FALLBACK_WARNING if not targets_apply(backend) else f"CRC32C: {backend}."
    runs = f"medians of {args.repeats} alternating runs" if args.repeats > 1 else "one run"
    parts = [f"{runs}; GB/s = 10^9 bytes/s"]
    if mode is not None:
        sync = "no fsync" if args.no_fsync else "fsync"
        where = args.dir or tempfile.gettempdir()
        parts.append(
            f"disk: {args.chunks} x {args.chunk_mib:g} MiB in {where} ({mode} I/O, {sync}), "
            f"against a sequential write + fsync / cold read of the same bytes (target >= "
            f"{_tiers_disk.TARGET:g})"
        )
    if not args.no_redis and not skipped:
        server = "the --redis-url server" if args.redis_url else "a private redis-server"
        parts.append(
            f"redis: {args.values} x {args.value_kib:g} KiB on {server}, against redis-benchmark "
            f"SET / GET, same size, connections and pipeline depth (target >= "
            f"{_tiers_redis.TARGET:g})"
        )
    if args.cluster and not skipped:
        parts.append(
            f"redis cluster: the same values on 3 and on 1 loopback primaries, against "
            f"redis-benchmark --cluster (target >= {_tiers_cluster.TARGET:g}; 3 vs 1: no target)"
        )
    if args.mooncake and not args.mooncake_skipped:
        where = "the --mooncake-master store" if args.mooncake_master else "a private store"
        parts.append(
            f"mooncake: {args.values} x {args.value_kib:g} KiB on {where} (master + one "
            f"storage node, tcp), against Mooncake's batch_put_from / batch_get_into of the "
            f"same rows, batches and threads (target >= {_tiers_mooncake.TARGET:g})"
        )
    for why in (skipped, args.mooncake_skipped):
        if why:
            parts.append(why)
    return first + "\n" + "; ".join(parts) + "."


def report(
    args: argparse.Namespace, rows: list[dict], backend: str, note: str, info: dict | None = None
) -> None:
    """Prints the tables (or the JSON document) and writes `tiers.csv` and `tiers.png`."""
    judge(rows, backend)
    info = {
        **(info or _report.machine()),
        "crc32c_backend": backend,
        "targets_apply": targets_apply(backend),
        "warning": None if targets_apply(backend) else FALLBACK_WARNING,
        "repeats": args.repeats,
    }
    title = "the tiers against their medium (same bytes, same run)"
    if not targets_apply(backend):
        title += "\n" + textwrap.fill(FALLBACK_WARNING, 96)
    tier_rows = [shown(r) for r in rows if r["kind"] == "tier"]
    other = [shown(r) for r in rows if r["kind"] != "tier"]
    tables = [(title, tier_rows, TIER_COLS), ("what else was measured", other, OTHER_COLS)]
    tables = [t for t in tables if t[1]]
    _report.emit("tiers", args, tables, rows, note=note, info=info)
    _report.write_csv(args.out / "tiers.csv", ROW_FIELDS, rows)
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
        plot(rows, args.out / "tiers.png", backend, info)


def plot(rows: list[dict], path: pathlib.Path, backend: str, info: dict) -> None:
    """One question: does each tier reach its target share of its medium's throughput?"""
    pairs = [r for r in rows if r["kind"] == "tier"]
    plt = _report.pyplot() if pairs else None
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(pairs)), 4.5))
    x = np.arange(len(pairs))
    # The cluster's "3 primaries vs 1" rows compare a cluster with one node; say so only
    # on a plot that has them.
    three = any("vs 1" in r["tier"] for r in pairs)
    label = "tier (3 vs 1: on 3 primaries)" if three else "tier"
    ax.bar(x - 0.2, [r["GBps"] for r in pairs], 0.4, label=label)
    label = "baseline (the medium; 3 vs 1: on 1 primary)" if three else "baseline (the medium)"
    ax.bar(x + 0.2, [r["baseline_GBps"] for r in pairs], 0.4, label=label)
    for i, r in enumerate(pairs):
        ax.text(
            i,
            max(r["GBps"], r["baseline_GBps"]),
            f"{r['ratio']:.2f}x" + (f"\n(target {r['target']:g})" if r["target"] else ""),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(x, [f"{textwrap.fill(r['tier'], 20)}\n{r['op']}" for r in pairs], fontsize=7)
    ax.set_ylabel("GB/s (10^9 bytes/s)")
    title = (
        "Secondary tiers vs the medium (same bytes, same run)\n"
        f"measured {_report.measured_on(info)}"
    )
    if not targets_apply(backend):
        title += "\nnumpy CRC32C fallback: ratios are not the tier's (pip install -e '.[tiers]')"
    ax.set_title(title, fontsize=10, color="black" if targets_apply(backend) else "red")
    top = max(max(r["GBps"], r["baseline_GBps"]) for r in pairs)
    ax.set_ylim(0, top * 1.3)  # room for the legend above the bars and their labels
    ax.legend(loc="upper left", fontsize=8, ncols=2, frameon=False)
    fig.tight_layout()
    _report.save(fig, path)


# -- arguments ------------------------------------------------------------------------


def writable_dir(text: str) -> str:
    """An argparse type: an existing directory this user may write into (the disk
    benchmark makes its files there)."""
    if not os.path.isdir(text):
        what = "is not a directory" if os.path.exists(text) else "does not exist"
        raise argparse.ArgumentTypeError(
            f"{text!r} {what}; give a directory on the filesystem to measure "
            f"(create it first: mkdir -p {text})"
        )
    if not os.access(text, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable by this user")
    return text


def redis_url(text: str) -> str:
    """An argparse type: a `redis://host:port/db` URL (redis-benchmark needs host:port)."""
    try:
        ep = RedisTierConfig(url=text).endpoint
    except TierConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if ep["path"] is not None or ep["scheme"] != "redis":
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a redis://host:port/db URL (redis-benchmark runs against host:port)"
        )
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    at_least_1 = _report.int_at_least(1)
    p.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    p.add_argument("--dir", type=writable_dir, default=None, help="directory to measure")
    p.add_argument("--chunks", type=at_least_1, default=None, help="disk chunks per pass")
    p.add_argument("--chunk-mib", type=_report.positive_float, default=2.0)
    p.add_argument("--job-chunks", type=at_least_1, default=16)
    p.add_argument("--direct-io", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--no-fsync", action="store_true", help="disk tier with fsync=False")
    p.add_argument("--repeats", type=at_least_1, default=3, help="alternating runs; medians")
    p.add_argument("--values", type=at_least_1, default=None, help="Redis values per pass")
    p.add_argument("--value-kib", type=_report.positive_float, default=1024)
    p.add_argument("--batch-mib", type=at_least_1, default=4, help="bytes one connection pipelines")
    p.add_argument("--redis-url", type=redis_url, default=None, help="a scratch server")
    p.add_argument("--no-disk", action="store_true")
    p.add_argument("--no-redis", action="store_true")
    p.add_argument("--clients", action="store_true", help="compare RESP clients too")
    p.add_argument("--cluster", action="store_true", help="the Redis Cluster part too")
    p.add_argument("--mooncake", action="store_true", help="the Mooncake Store part too")
    p.add_argument("--mooncake-master", default=None, help="host:port of a scratch store")
    p.add_argument("--mooncake-metadata", default=None, help="its metadata server URL")
    _report.add_output_args(p, pathlib.Path(__file__).resolve().parent / "results")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.chunks = args.chunks or (48 if args.quick else 256)
    args.values = args.values or (64 if args.quick else 256)
    if int(args.chunk_mib * MiB) < 1 or int(args.value_kib * 1024) < 1:
        p.error("--chunk-mib / --value-kib: a chunk or value must be at least one byte")
    if args.no_disk and args.dir:
        p.error("--dir: names the directory the disk part measures; drop it or --no-disk")
    if bool(args.mooncake_master) != bool(args.mooncake_metadata):
        p.error("--mooncake-master and --mooncake-metadata name one store: give both")
    if args.mooncake_master and not args.mooncake:
        p.error("--mooncake-master: belongs to the Mooncake part; add --mooncake")
    args.mooncake_skipped = ""
    for flag in ("redis_url", "clients"):
        if args.no_redis and getattr(args, flag) and not (flag == "clients" and args.cluster):
            name = "--" + flag.replace("_", "-")
            p.error(f"{name}: belongs to the Redis part, which --no-redis skips; drop one")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backend = crc_backend()
    if not targets_apply(backend):
        print(FALLBACK_WARNING, file=sys.stderr)  # seen at the start, with --json too
    skipped = ""
    redis, cluster = not args.no_redis, args.cluster
    tools = ("redis-server", "redis-benchmark") + (("redis-cli",) if cluster else ())
    if (redis or cluster) and not all(shutil.which(t) for t in tools):
        skipped = f"{' / '.join(tools)} not installed: Redis parts skipped"
        redis = cluster = False
        print(skipped, file=sys.stderr)
    steps = 1 + (0 if args.no_disk else args.repeats) + (args.repeats + args.clients) * redis
    steps += (args.repeats + args.clients) * cluster
    mooncake = args.mooncake
    if mooncake and (why := _tiers_mooncake.available()):
        args.mooncake_skipped, mooncake = why, False
        print(why, file=sys.stderr)
    steps += args.repeats * mooncake
    progress = _report.Progress(steps, quiet=args.quiet)
    rows: list[dict] = []
    progress.step("CRC32C of 8 MiB")
    bench_crc(rows)
    mode = None if args.no_disk else _tiers_disk.bench_disk(args, rows, progress.step)
    if redis:
        _tiers_redis.bench_redis(args, rows, progress.step)
    if cluster:
        _tiers_cluster.bench_cluster(args, rows, progress.step)
    if mooncake:
        _tiers_mooncake.bench_mooncake(args, rows, progress.step)
    progress.finish()
    report(args, rows, backend, note_for(args, backend, mode, skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
