"""The disk part of benchmarks/tiers.py: `DiskTier` against the filesystem it writes to.

`DiskTier` stores and loads `--chunks` chunks of `--chunk-mib` MiB (jobs of
`--job-chunks`) against a plain sequential write (then fsync) and read of the same bytes
to one file in the same directory, buffered and O_DIRECT; the ratio is taken against the
faster of the two (target >= 0.8). Reads are cold: the page cache of the files is dropped
(`posix_fadvise(DONTNEED)`) before every read pass. Also measured: bare files, one per
chunk, 8 threads, no header, no fsync (what file-per-chunk layouts cost by themselves).
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from _tiers_common import NS, info_row, keys, rows_buffer, tier_row

from jax_kvoffload.tiers import DiskTier, DiskTierConfig

TARGET = 0.8


def drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_tree_cache(root: str) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            drop_cache(os.path.join(d, f))


def sequential(path: str, rows: np.ndarray, direct: bool) -> tuple[float, float]:
    """(write seconds, read seconds) of the rows as one file, written then fsynced."""
    flags = os.O_CREAT | os.O_TRUNC | os.O_WRONLY | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    t0 = time.perf_counter()
    for r in rows:
        os.write(fd, r)
    os.fsync(fd)
    w = time.perf_counter() - t0
    os.close(fd)
    drop_cache(path)
    out = mmap.mmap(-1, rows.shape[1])
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    t0 = time.perf_counter()
    while os.readv(fd, [out]) > 0:
        pass
    r = time.perf_counter() - t0
    os.close(fd)
    out.close()
    os.unlink(path)
    return w, r


def per_file(base: str, rows: np.ndarray, direct: bool, threads: int) -> tuple[float, float]:
    """(write s, read s) of one file per row, `threads` at a time, no header, no fsync:
    what the filesystem charges for file-per-chunk layouts, apart from the tier."""
    os.makedirs(base)
    flag = os.O_DIRECT if direct else 0

    def write(i):
        fd = os.open(f"{base}/{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | flag, 0o600)
        os.pwritev(fd, [rows[i]], 0)
        os.close(fd)

    def read(i):
        fd = os.open(f"{base}/{i}", os.O_RDONLY | flag)
        os.preadv(fd, [sinks[i % threads]], 0)
        os.close(fd)

    sinks = [mmap.mmap(-1, rows.shape[1]) for _ in range(threads)]
    with ThreadPoolExecutor(threads) as ex:
        t0 = time.perf_counter()
        list(ex.map(write, range(len(rows))))
        w = time.perf_counter() - t0
        drop_tree_cache(base)
        t0 = time.perf_counter()
        list(ex.map(read, range(len(rows))))
        r = time.perf_counter() - t0
    for m in sinks:
        m.close()
    shutil.rmtree(base)
    return w, r


def tier_pass(args: argparse.Namespace, path: str, rows, dest, times: dict) -> str:
    """Stores the rows into a fresh `DiskTier` at `path`, loads them back cold; appends
    both times; returns the I/O mode the tier chose ("direct" or "buffered")."""
    n, size = rows.shape
    tier = DiskTier(
        DiskTierConfig(
            path=path,
            capacity_bytes=4 * n * size,
            max_pending_store_bytes=2 * n * size,
            direct_io=args.direct_io,
            fsync=not args.no_fsync,
        ),
        NS,
    )
    mode = "direct" if tier.direct_io else "buffered"
    ks = keys(n)
    jobs = [range(i, min(n, i + args.job_chunks)) for i in range(0, n, args.job_chunks)]
    t0 = time.perf_counter()
    futs = [tier.submit_store([(ks[i], rows[i]) for i in job]) for job in jobs]
    ok = all(f.result().all_ok for f in futs)
    times.setdefault("tier store", []).append(time.perf_counter() - t0)
    drop_tree_cache(path)
    dest[:] = 0
    t0 = time.perf_counter()
    futs = [tier.submit_load([(ks[i], dest[i]) for i in job]) for job in jobs]
    ok = ok and all(f.result().all_ok for f in futs)
    times.setdefault("tier load", []).append(time.perf_counter() - t0)
    assert ok and np.array_equal(dest, rows), "disk tier lost or changed bytes"
    tier.close()
    shutil.rmtree(path)
    return mode


def bench_disk(args: argparse.Namespace, out_rows: list[dict], step: Callable[[str], None]) -> str:
    """Appends the disk rows to `out_rows`; returns the tier's I/O mode. `step(what)`
    announces each repeat (between passes, never inside a timed one)."""
    size = int(args.chunk_mib * (1 << 20))
    n = args.chunks
    base = tempfile.mkdtemp(prefix="jkv-bench-", dir=args.dir)
    m, rows = rows_buffer(n, size)
    dest_m, dest = rows_buffer(n, size)
    times: dict[str, list[float]] = {}
    mode = "?"
    try:
        # Alternate the baselines and the tier, `--repeats` times, on a fresh directory
        # each time; medians of each (the machine is shared and noisy).
        for rep in range(args.repeats):
            step(f"disk: repeat {rep + 1}/{args.repeats}, {n} x {args.chunk_mib:g} MiB")
            for d in (False, True):
                w, r = sequential(os.path.join(base, f"seq{int(d)}"), rows, d)
                times.setdefault(f"seq{int(d)} store", []).append(w)
                times.setdefault(f"seq{int(d)} load", []).append(r)
            w, r = per_file(os.path.join(base, "files"), rows, args.direct_io != "off", 8)
            times.setdefault("files store", []).append(w)
            times.setdefault("files load", []).append(r)
            mode = tier_pass(args, os.path.join(base, f"tier{rep}"), rows, dest, times)
        med = {k: statistics.median(v) for k, v in times.items()}
        sync = "" if not args.no_fsync else ", no fsync"
        for op in ("store", "load"):
            best = min((med[f"seq{d} {op}"], d) for d in (0, 1))
            base_name = f"sequential {'O_DIRECT' if best[1] else 'buffered'} {op}"
            out_rows.append(
                tier_row(
                    f"disk ({mode}{sync})",
                    op,
                    n * size,
                    med[f"tier {op}"],
                    base_name,
                    best[0],
                    TARGET,
                )
            )
            for name, what in (
                ("seq0", "sequential buffered"),
                ("seq1", "sequential O_DIRECT"),
                ("files", "bare file per chunk, 8 threads,"),
            ):
                secs = med[f"{name} {op}"]
                out_rows.append(info_row("baseline", "disk", f"{what} {op}", n * size, secs))
    finally:
        del rows, dest
        m.close()
        dest_m.close()
        shutil.rmtree(base, ignore_errors=True)
    return mode
