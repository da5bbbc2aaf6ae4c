"""The Mooncake part of benchmarks/tiers.py (`--mooncake`): `MooncakeTier` against
Mooncake's own Python batch calls moving the same bytes through the same master.

A private Mooncake Store on loopback (`mooncake_master` with its HTTP metadata server
and one storage node, `mooncake_client`, mounting the segment), or `--mooncake-master`
/ `--mooncake-metadata` of a scratch store. The tier stores `n` host rows (one mmap'd
buffer, registered once) in jobs of `--job-chunks` and loads them back; the baseline
is a bare `MooncakeDistributedStore` on the same buffers (registered too) calling
`batch_put_from` / `batch_get_into` on the same batches from as many threads as the
tier has (target >= 0.8). Every pass writes new keys; the store is emptied between
repeats, after an untimed pass of each that has the storage node touch its pages.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable

import numpy as np
from _tiers_common import NS, MiB, keys, rows_buffer, tier_row

from jax_kvoffload.tiers import MooncakeTier, MooncakeTierConfig

TARGET = 0.8
THREADS = 4  # the tier's read and write threads, and the baseline's


def available() -> str | None:
    """Why the Mooncake part cannot run here, or None."""
    if importlib.util.find_spec("mooncake") is None:
        return "mooncake-transfer-engine-non-cuda not installed: Mooncake part skipped"
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        return f"Mooncake does not import ({e}): Mooncake part skipped"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(port: int, proc: subprocess.Popen) -> None:
    for _ in range(400):
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.1):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"a Mooncake process did not listen on port {port}")


class PrivateStore:
    """`mooncake_master` and one storage node of `segment` bytes on loopback ports."""

    def __init__(self, segment: int) -> None:
        bindir = os.path.dirname(importlib.util.find_spec("mooncake").origin)
        self.dir = tempfile.mkdtemp(prefix="jkv-bench-mooncake-")
        port, http, metrics, node = (_free_port() for _ in range(4))
        self.master = f"127.0.0.1:{port}"
        self.metadata = f"http://127.0.0.1:{http}/metadata"
        log = open(os.path.join(self.dir, "log"), "ab")  # noqa: SIM115 (the children's)
        self.procs = [
            subprocess.Popen(
                [
                    os.path.join(bindir, "mooncake_master"),
                    f"--port={port}",
                    "--rpc_address=127.0.0.1",
                    "--enable_http_metadata_server=true",
                    "--http_metadata_server_host=127.0.0.1",
                    f"--http_metadata_server_port={http}",
                    "--metrics_host=127.0.0.1",
                    f"--metrics_port={metrics}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        ]
        _wait(port, self.procs[0])
        _wait(http, self.procs[0])
        self.procs.append(
            subprocess.Popen(
                [
                    os.path.join(bindir, "mooncake_client"),
                    f"--global_segment_size={segment}",
                    "--host=127.0.0.1",
                    f"--port={node}",
                    f"--master_server_address={self.master}",
                    f"--metadata_server={self.metadata}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        log.close()
        _wait(node, self.procs[1])

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def raw_client(master: str, metadata: str):
    from mooncake.store import MooncakeDistributedStore

    c = MooncakeDistributedStore()
    if c.setup("127.0.0.1", metadata, 0, 0, "tcp", "", master) != 0:
        raise RuntimeError(f"Mooncake's client did not reach the master at {master}")
    return c


def _jobs(n: int, per: int) -> list[range]:
    return [range(a, min(n, a + per)) for a in range(0, n, per)]


def tier_pass(tier, rows, dest, ks, job: int, times: dict) -> None:
    """Stores the rows under new keys `ks`, loads them back; appends both times."""
    t0 = time.perf_counter()
    futs = [tier.submit_store([(ks[i], rows[i]) for i in r]) for r in _jobs(len(ks), job)]
    ok = all(f.result().all_ok for f in futs)
    times.setdefault("store", []).append(time.perf_counter() - t0)
    dest[:] = 0
    t0 = time.perf_counter()
    futs = [tier.submit_load([(ks[i], dest[i]) for i in r]) for r in _jobs(len(ks), job)]
    ok = ok and all(f.result().all_ok for f in futs)
    times.setdefault("load", []).append(time.perf_counter() - t0)
    assert ok and np.array_equal(dest, rows), "the Mooncake tier lost or changed bytes"


def baseline_pass(client, pool, rows, dest, names, per_batch: int, times: dict) -> None:
    """Mooncake's batch_put_from / batch_get_into of the same rows, the same batches,
    from THREADS threads; appends both times."""
    size = rows.shape[1]
    src, dst = rows.ctypes.data, dest.ctypes.data
    batches = _jobs(len(names), per_batch)

    def put(r):
        return client.batch_put_from(
            [names[i] for i in r], [src + i * size for i in r], [size] * len(r)
        )

    def get(r):
        return client.batch_get_into(
            [names[i] for i in r], [dst + i * size for i in r], [size] * len(r)
        )

    t0 = time.perf_counter()
    codes = [c for out in pool.map(put, batches) for c in out]
    times.setdefault("put", []).append(time.perf_counter() - t0)
    dest[:] = 0
    t0 = time.perf_counter()
    got = [c for out in pool.map(get, batches) for c in out]
    times.setdefault("get", []).append(time.perf_counter() - t0)
    assert codes == [0] * len(names), f"Mooncake's puts failed: {sorted(set(codes))}"
    assert got == [size] * len(names), f"Mooncake's gets failed: {sorted(set(got))}"
    assert np.array_equal(dest, rows), "Mooncake's own calls changed bytes"


def bench_mooncake(
    args: argparse.Namespace, out_rows: list[dict], step: Callable[[str], None]
) -> None:
    """Appends the Mooncake rows to `out_rows`; `step(what)` announces each repeat."""
    size = int(args.value_kib * 1024)
    n = args.values
    per_batch = max(1, (args.batch_mib * MiB) // size)
    store = None
    if args.mooncake_master:
        master, metadata = args.mooncake_master, args.mooncake_metadata
    else:
        store = PrivateStore(4 * n * size + 64 * MiB)  # a tier pass and a baseline pass
        master, metadata = store.master, store.metadata
    m, rows = rows_buffer(n, size)
    dest_m, dest = rows_buffer(n, size)
    client = tier = None
    pool = cf.ThreadPoolExecutor(THREADS)
    try:
        client = raw_client(master, metadata)
        # Mooncake's zero-copy calls want registered memory.
        assert client.register_buffer(rows.ctypes.data, rows.nbytes) == 0
        assert client.register_buffer(dest.ctypes.data, dest.nbytes) == 0
        cfg = MooncakeTierConfig(
            master_server_address=master,
            metadata_server=metadata,
            local_hostname="127.0.0.1",
            read_threads=THREADS,
            write_threads=THREADS,
            batch_bytes=per_batch * size,
            max_pending_store_bytes=2 * n * size,
        )
        tier = MooncakeTier(cfg, NS)
        # Untimed: the storage node touches its segment's pages (and both sides open
        # their connections) once, so no timed pass pays that first touch.
        warm = [f"bench:warm:{k.hex()}" for k in keys(n)]
        baseline_pass(client, pool, rows, dest, warm, per_batch, {})
        tier_pass(tier, rows, dest, keys(n, b"warm"), args.job_chunks, {})
        client.remove_all(True)
        times: dict[str, list[float]] = {}
        for rep in range(args.repeats):
            step(f"mooncake: repeat {rep + 1}/{args.repeats}, {n} x {args.value_kib:g} KiB")
            for which in ("tier", "baseline")[:: 1 if rep % 2 == 0 else -1]:
                if which == "tier":
                    tier_pass(tier, rows, dest, keys(n, b"m%d" % rep), args.job_chunks, times)
                else:
                    names = [f"bench:{rep}:{k.hex()}" for k in keys(n)]
                    baseline_pass(client, pool, rows, dest, names, per_batch, times)
            client.remove_all(True)
        med = {k: statistics.median(v) for k, v in times.items()}
        for op, call in (("store", "put"), ("load", "get")):
            base = f"Mooncake batch_{call}_{'from' if call == 'put' else 'into'} x{THREADS}"
            out_rows.append(tier_row("mooncake", op, n * size, med[op], base, med[call], TARGET))
    finally:
        pool.shutdown()
        if tier is not None:
            tier.close()
        if client is not None:
            client.unregister_buffer(rows.ctypes.data)
            client.unregister_buffer(dest.ctypes.data)
            client.close()
        del rows, dest
        with contextlib.suppress(BufferError):  # a failed pass's traceback holds rows
            m.close()
            dest_m.close()
        if store is not None:
            store.stop()
