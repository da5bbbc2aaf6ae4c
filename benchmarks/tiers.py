"""Secondary-tier throughput against what the medium itself does, measured in one run.

Disk: `DiskTier` stores and loads `--chunks` chunks of `--chunk-mib` MiB (jobs of
`--job-chunks`) against a plain sequential write (then fsync) and read of the same bytes
to one file in the same directory, buffered and O_DIRECT; the ratio is taken against the
faster of the two (target >= 0.8). Reads are cold: the page cache of the files is dropped
(`posix_fadvise(DONTNEED)`) before every read pass.

Redis: `RedisTier` against `redis-benchmark` SET / GET at the same value size, the same
number of connections and the same pipeline depth, against the same server (one started
here on a free loopback port, or `--redis-url` of a scratch server: redis-benchmark writes
`key:*` keys into it; target >= 0.7). With `--clients`, the
client choice: our RESP client against redis-py (+hiredis) and coredis, pipelined, one
connection each.

Usage:
  python benchmarks/tiers.py --quick      # small sizes, ~20 s
  python benchmarks/tiers.py              # 512 MiB per disk pass
  python benchmarks/tiers.py --out DIR    # CSV + PNG (default benchmarks/results/)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import mmap
import os
import pathlib
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # _report, beside us
import _report

from jax_kvoffload.tiers import (
    CRC32C_BACKEND,
    DiskTier,
    DiskTierConfig,
    RedisTier,
    RedisTierConfig,
)
from jax_kvoffload.tiers._crc import crc32c, crc32c_numpy

MiB = 1 << 20
NAN = float("nan")
NS = bytes(range(32))
COLS = ["tier", "op", "bytes_MiB", "tier_GBps", "baseline", "baseline_GBps", "ratio", "target"]


def rows_buffer(n: int, size: int) -> tuple[mmap.mmap, np.ndarray]:
    """`n` page-aligned rows of `size` random bytes (as vLLM's and our shared host rows)."""
    m = mmap.mmap(-1, n * size)
    a = np.frombuffer(m, dtype=np.uint8).reshape(n, size)
    a[:] = np.random.default_rng(0).integers(0, 256, a.shape, dtype=np.uint8)
    return m, a


def keys(n: int, salt: bytes = b"") -> list[bytes]:
    return [os.urandom(28) + salt.ljust(4, b"\0")[:4] + (0).to_bytes(4, "big") for _ in range(n)]


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
    from concurrent.futures import ThreadPoolExecutor

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


def bench_disk(args, out_rows: list[dict]) -> None:
    size = int(args.chunk_mib * MiB)
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
            for d in (False, True):
                w, r = sequential(os.path.join(base, f"seq{int(d)}"), rows, d)
                times.setdefault(f"seq{int(d)} store", []).append(w)
                times.setdefault(f"seq{int(d)} load", []).append(r)
            w, r = per_file(os.path.join(base, "files"), rows, args.direct_io != "off", 8)
            times.setdefault("files store", []).append(w)
            times.setdefault("files load", []).append(r)
            path = os.path.join(base, f"tier{rep}")
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
        med = {k: statistics.median(v) for k, v in times.items()}
        sync = "" if not args.no_fsync else ", no fsync"
        for op in ("store", "load"):
            best = min((med[f"seq{d} {op}"], d) for d in (0, 1))
            base_name = f"sequential {'O_DIRECT' if best[1] else 'buffered'} {op}"
            out_rows.append(
                _row(
                    f"disk ({mode}{sync})", op, n * size, med[f"tier {op}"], base_name, best[0], 0.8
                )
            )
            for name, what in (
                ("seq0", "sequential buffered"),
                ("seq1", "sequential O_DIRECT"),
                ("files", "bare file per chunk, 8 threads,"),
            ):
                gbps = n * size / med[f"{name} {op}"] / 1e9
                out_rows.append(_info("-", f"{what} {op}", n * size, baseline_gbps=gbps))
    finally:
        del rows, dest
        m.close()
        dest_m.close()
        shutil.rmtree(base, ignore_errors=True)


def _info(tier: str, op: str, nbytes: int, *, tier_gbps=NAN, baseline_gbps=NAN) -> dict:
    """A row without a ratio (a baseline alone, a client, a checksum)."""
    return {
        "tier": tier,
        "op": op,
        "bytes_MiB": nbytes / MiB,
        "tier_GBps": tier_gbps,
        "baseline": "-",
        "baseline_GBps": baseline_gbps,
        "ratio": NAN,
        "target": "",
    }


def _row(tier, op, nbytes, tier_s, base_name, base_s, target) -> dict:
    t, b = nbytes / tier_s / 1e9, nbytes / base_s / 1e9
    return {
        "tier": tier,
        "op": op,
        "bytes_MiB": nbytes / MiB,
        "tier_GBps": t,
        "baseline": base_name,
        "baseline_GBps": b,
        "ratio": t / b,
        "target": f">= {target}",
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(maxmemory: int) -> tuple[subprocess.Popen, int, str]:
    port, d = free_port(), tempfile.mkdtemp(prefix="jkv-bench-redis-")
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            str(maxmemory),
            "--maxmemory-policy",
            "allkeys-lru",
            "--dir",
            d,
        ],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), 0.1).close()
            break
        except OSError:
            time.sleep(0.02)
    return proc, port, d


def redis_benchmark(
    host: str, port: int, test: str, size: int, n: int, c: int, p: int, *, keyspace: int
) -> float:
    """Requests per second of `redis-benchmark -t test` on keys `key:<0..keyspace-1>`."""
    out = subprocess.run(
        [
            "redis-benchmark",
            "-h",
            host,
            "-p",
            str(port),
            "-t",
            test,
            "-d",
            str(size),
            "-n",
            str(n),
            "-c",
            str(c),
            "-P",
            str(p),
            "-r",
            str(keyspace),
            "--csv",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    line = [ln for ln in out.splitlines() if ln.startswith(f'"{test.upper()}"')][-1]
    return float(line.split(",")[1].strip('"'))


def redis_tier_pass(tier, rows, dest, ks, job: int, times: dict) -> None:
    """Stores the rows under new keys `ks`, loads them back; appends both times."""
    n = len(ks)
    t0 = time.perf_counter()
    futs = [
        tier.submit_store([(ks[i], rows[i]) for i in range(a, min(n, a + job))])
        for a in range(0, n, job)
    ]
    ok = all(f.result().all_ok for f in futs)
    times.setdefault("store", []).append(time.perf_counter() - t0)
    dest[:] = 0
    t0 = time.perf_counter()
    futs = [
        tier.submit_load([(ks[i], dest[i]) for i in range(a, min(n, a + job))])
        for a in range(0, n, job)
    ]
    ok = ok and all(f.result().all_ok for f in futs)
    times.setdefault("load", []).append(time.perf_counter() - t0)
    assert ok and np.array_equal(dest, rows), "redis tier lost or changed bytes"


def redis_baseline_pass(url: str, size: int, n: int, conns: int, depth: int, times: dict) -> None:
    """redis-benchmark SET then GET of `n` values of `size` bytes; appends both times."""
    ep = RedisTierConfig(url=url).endpoint
    host, port = ep["host"], ep["port"]
    # SET: n values under (almost surely) n new keys, as a tier store writes them: with
    # `-r n` a third of the SETs would overwrite a key of the same pass.
    rps = redis_benchmark(host, port, "set", size, n, conns, depth, keyspace=10**9)
    times.setdefault("set", []).append(n / rps)
    # GET: `-r n` draws keys with repeats, so every key is set first: each GET moves one
    # value, as each tier load does (checked: the server counted no keyspace miss).
    misses = fill_benchmark_keys(url, n, size)
    rps = redis_benchmark(host, port, "get", size, n, conns, depth, keyspace=n)
    times.setdefault("get", []).append(n / rps)
    assert fill_benchmark_keys(url, 0, size) == misses, "redis-benchmark GET missed"


def bench_redis(args, out_rows: list[dict]) -> None:
    size = int(args.value_kib * 1024)
    n = args.values
    conns = 4
    per_batch = max(1, (args.batch_mib * MiB) // size)
    proc = None
    if args.redis_url:
        url = args.redis_url
        ep = RedisTierConfig(url=url).endpoint
        host, port = ep["host"], ep["port"]
    else:
        proc, port, d = start_redis(4 * n * size + 64 * MiB)  # tier, SET, GET passes
        host, url = "127.0.0.1", f"redis://127.0.0.1:{port}/0"
    m, rows = rows_buffer(n, size)
    try:
        tier = RedisTier(
            RedisTierConfig(
                url=url,
                read_connections=conns,
                write_connections=conns,
                batch_bytes=per_batch * size,
                max_pending_store_bytes=2 * n * size,
            ),
            NS,
        )
        dest_m, dest = rows_buffer(n, size)
        job = args.job_chunks
        times: dict[str, list[float]] = {}

        for rep in range(args.repeats):
            # Alternating which goes first: both meet the server in the same states.
            for which in ("tier", "baseline")[:: 1 if rep % 2 == 0 else -1]:
                if which == "tier":
                    redis_tier_pass(tier, rows, dest, keys(n, b"b%d" % rep), job, times)
                else:
                    redis_baseline_pass(url, size, n, conns, per_batch, times)
            if proc is not None:
                tier_call_flush(url)
        tier.close()
        del dest
        dest_m.close()
        med = {k: statistics.median(v) for k, v in times.items()}
        for op, test in (("store", "set"), ("load", "get")):
            out_rows.append(
                _row(
                    "redis",
                    op,
                    n * size,
                    med[op],
                    f"redis-benchmark {test.upper()} -c {conns} -P {per_batch}",
                    med[test],
                    0.7,
                )
            )
        if args.clients:
            bench_clients(host, port, size, min(n, 64), out_rows)
    finally:
        del rows
        m.close()
        if proc is not None:
            proc.terminate()
            proc.wait()
            shutil.rmtree(d, ignore_errors=True)


def fill_benchmark_keys(url: str, n: int, size: int) -> int:
    """Sets redis-benchmark's keys `key:<12 digits>` 0..n-1 to `size` bytes each; returns
    the server's keyspace_misses counter (to check that the GET baseline missed none)."""
    from jax_kvoffload.tiers._redis import endpoint_from_config
    from jax_kvoffload.tiers._resp import RespConnection

    conn = RespConnection(endpoint_from_config(RedisTierConfig(url=url)))
    conn.connect()
    try:
        value = os.urandom(size)
        for a in range(0, n, 16):
            ks = range(a, min(n, a + 16))
            conn.begin()
            conn.send(
                [
                    b"*3\r\n$3\r\nSET\r\n$16\r\nkey:%012d\r\n$%d\r\n" % (i, size) + value + b"\r\n"
                    for i in ks
                ]
            )
            assert all(conn.read_reply() == "OK" for _ in ks)
        info = conn.call(b"INFO", b"stats").decode()
        return int(info.split("keyspace_misses:")[1].split()[0])
    finally:
        conn.close()


def tier_call_flush(url: str) -> None:
    """Empties the benchmark's own server between repeats (never a server given by URL)."""
    from jax_kvoffload.tiers._redis import endpoint_from_config
    from jax_kvoffload.tiers._resp import RespConnection

    conn = RespConnection(endpoint_from_config(RedisTierConfig(url=url)))
    conn.connect()
    try:
        conn.call(b"FLUSHDB")
    finally:
        conn.close()


def bench_clients(host: str, port: int, size: int, n: int, out_rows: list[dict]) -> None:
    """SET / GET of `n` values, pipelined on one connection: ours, redis-py, coredis."""
    from jax_kvoffload.tiers._resp import Endpoint, RespConnection, command

    val = os.urandom(size)
    ks = [b"client:%d" % i for i in range(n)]
    sink = bytearray(size)
    conn = RespConnection(Endpoint(host, port, None, 0, None, None, None, None, 2.0, 30.0))
    conn.connect()

    def ours_set():
        conn.begin()
        parts = []
        for k in ks:
            parts += [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, size), val, b"\r\n"]
        conn.send(parts)
        for _ in ks:
            conn.read_reply()

    def ours_get():
        conn.begin()
        conn.send([command(b"GET", k) for k in ks])
        for _ in ks:
            conn.read_into(memoryview(sink)[: conn.read_bulk_header()])
            conn.end_bulk()

    clients = {"ours (RESP, zero-copy)": (ours_set, ours_get)}
    try:
        import redis

        r = redis.Redis(host=host, port=port)

        def rp(op):
            def run():
                p = r.pipeline(transaction=False)
                for k in ks:
                    p.set(k, val) if op == "set" else p.get(k)
                p.execute()

            return run

        hi = "hiredis" if redis.utils.HIREDIS_AVAILABLE else "python parser"
        clients[f"redis-py ({hi})"] = (rp("set"), rp("get"))
    except ImportError:
        pass
    try:
        import coredis

        async def cd(op):
            async with coredis.Redis(host=host, port=port) as c:

                async def once():
                    async with c.pipeline(transaction=False) as p:
                        for k in ks:
                            p.set(k, val) if op == "set" else p.get(k)

                await once()
                t0 = time.perf_counter()
                for _ in range(3):
                    await once()
                return (time.perf_counter() - t0) / 3

        clients["coredis"] = (lambda: asyncio.run(cd("set")), lambda: asyncio.run(cd("get")))
    except ImportError:
        pass
    for name, (s, g) in clients.items():
        for op, fn in (("client SET", s), ("client GET", g)):
            secs = fn() if name == "coredis" else _report.median(fn, 3, warmup=True)
            out_rows.append(_info(name, op, n * size, tier_gbps=n * size / secs / 1e9))
    conn.close()


def bench_crc(out_rows: list[dict]) -> None:
    data = np.frombuffer(os.urandom(8 * MiB), dtype=np.uint8)
    for name, fn in ((CRC32C_BACKEND, crc32c), ("numpy fallback", crc32c_numpy)):
        secs = _report.median(lambda fn=fn: fn(data), 3, warmup=True)
        out_rows.append(
            _info(f"CRC32C {name}", "checksum", data.size, tier_gbps=data.size / secs / 1e9)
        )


def print_table(rows: list[dict]) -> None:
    heads = [
        "tier",
        "operation",
        "MiB",
        "tier GB/s",
        "baseline",
        "baseline GB/s",
        "ratio",
        "target",
    ]
    keys_ = COLS
    cells = [[_fmt(r[k]) for k in keys_] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    right = {2, 3, 5, 6}

    def line(vals):
        return "  ".join(
            v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(vals, widths))
        )

    print(line(heads))
    print(line(["-" * w for w in widths]))
    for c in cells:
        print(line(c))


def _fmt(v) -> str:
    if isinstance(v, float):
        return "-" if v != v else f"{v:.3f}" if v < 100 else f"{v:.0f}"
    return str(v)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    plt = _report.pyplot()
    if plt is None:
        return
    pairs = [r for r in rows if r["baseline"] != "-"]
    fig, ax = plt.subplots(figsize=(8, 4))
    x = np.arange(len(pairs))
    ax.bar(x - 0.2, [r["tier_GBps"] for r in pairs], 0.4, label="tier")
    ax.bar(x + 0.2, [r["baseline_GBps"] for r in pairs], 0.4, label="baseline")
    for i, r in enumerate(pairs):
        ax.text(
            i,
            max(r["tier_GBps"], r["baseline_GBps"]),
            f"{r['ratio']:.2f}x",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(x, [f"{r['tier']}\n{r['op']}" for r in pairs], fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title("Secondary tiers vs the medium (same bytes, same run)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


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
    from jax_kvoffload.config import TierConfigError

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
    p.add_argument("--quick", action="store_true", help="small sizes (~20 s)")
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
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).parent / "results")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.chunks = args.chunks or (48 if args.quick else 256)
    args.values = args.values or (64 if args.quick else 256)
    if int(args.chunk_mib * MiB) < 1 or int(args.value_kib * 1024) < 1:
        p.error("--chunk-mib / --value-kib: a chunk or value must be at least one byte")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(
        f"{datetime.date.today()} {platform.node()} {platform.machine()} "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}, CRC32C: {CRC32C_BACKEND}"
    )
    rows: list[dict] = []
    bench_crc(rows)
    if not args.no_disk:
        bench_disk(args, rows)
    if not args.no_redis:
        if shutil.which("redis-server") and shutil.which("redis-benchmark"):
            bench_redis(args, rows)
        else:
            print("redis-server / redis-benchmark not installed: Redis part skipped")
    print_table(rows)
    _report.write_csv(args.out / "tiers.csv", COLS, rows)
    plot(rows, args.out / "tiers.png")


if __name__ == "__main__":
    main()
