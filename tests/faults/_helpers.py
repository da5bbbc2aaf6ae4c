"""Shared pieces of the fault suite: tiny offloaders, key-determined block contents,
fault injectors, and the checks every scenario ends with (reports, pins, threads)."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from jax_kvoffload import GroupCaches, KVOffloader
from jax_kvoffload.config import (
    CacheConfig,
    EngineConfig,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVTransferConfig,
    ModelConfig,
    SlidingWindowSpec,
    build_offloading_config,
)
from jax_kvoffload.hostmem import HostChunkPool
from jax_kvoffload.store import HostStore

NB, BS, H, D = 32, 4, 2, 8  # blocks, tokens per block, KV heads, head dim
LAYERS = 2
PAGE = 4096  # host page: one chunk row of 2 blocks x 2 layers x 256 B rounds up to it


def config(bpc: int = 2, chunks: int = 6, window: int | None = None, **extra):
    """A one-group config (uint16 caches) whose budget buys exactly `chunks` chunks."""
    # Each layer's array holds K|V packed along its last axis: head_size is half of D.
    common = dict(block_size=BS, num_kv_heads=H, head_size=D // 2, dtype="uint16")
    spec = (
        FullAttentionSpec(**common)
        if window is None
        else SlidingWindowSpec(**common, sliding_window=window)
    )
    engine = EngineConfig(
        model_config=ModelConfig(model="m", dtype="float16", total_num_kv_heads=H),
        cache_config=CacheConfig(block_size=BS),
        kv_transfer_config=KVTransferConfig(
            kv_connector_extra_config={
                "cpu_bytes_to_use": chunks * PAGE,
                "blocks_per_chunk": bpc,
                **extra,
            },
            engine_id="faults",
        ),
    )
    layers = tuple(f"l{i}" for i in range(LAYERS))
    kv = KVCacheConfig(
        num_blocks=NB,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec),),
    )
    return build_offloading_config(engine, kv)


def noise(seed: int = 0) -> list[jax.Array]:
    rng = np.random.default_rng(seed)
    shape = (NB, BS, H, D)
    return [jnp.asarray(rng.integers(0, 2**16, shape, dtype=np.uint16)) for _ in range(LAYERS)]


def offloader(cfg=None, seed: int = 0, **kw) -> KVOffloader:
    caches = GroupCaches(noise(seed), pk.KVLayout.nhd())
    return KVOffloader(cfg or config(), caches, backend="xla", **kw)


def hashes(prefix: str, n: int) -> list[bytes]:
    """Block hashes of a prompt: each covers its whole prefix, like vLLM's."""
    out, parent = [], b""
    for i in range(n):
        parent = hashlib.sha256(parent + f"{prefix}:{i}".encode()).digest()
        out.append(parent)
    return out


def content(block_hash: bytes) -> np.ndarray:
    """What a block with this hash holds, `[LAYERS, BS, H, D]` uint16: a function of the
    hash alone, as in a real engine, so the bytes under any key are known forever."""
    seed = int.from_bytes(hashlib.sha256(b"bytes:" + block_hash).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 2**16, (LAYERS, BS, H, D), dtype=np.uint16)


def write_blocks(off: KVOffloader, block_ids: list[int], block_hashes: list[bytes]) -> None:
    """The engine's prefill: writes each hash's content into its block."""
    ids = np.asarray(block_ids)
    data = np.stack([content(h) for h in block_hashes], axis=1)  # [LAYERS, n, ...]
    arrays = off.caches()
    off.set_caches([a.at[ids].set(jnp.asarray(data[i])) for i, a in enumerate(arrays)])


def blocks(off: KVOffloader, block_ids: list[int]) -> np.ndarray:
    """`[LAYERS, n, BS, H, D]` as the device holds them now."""
    ids = np.asarray(block_ids)
    return np.stack([np.asarray(a)[ids] for a in off.caches()])


def expected(block_hashes: list[bytes]) -> np.ndarray:
    return np.stack([content(h) for h in block_hashes], axis=1)


def pins(off: KVOffloader) -> tuple[int, int]:
    """(pinned chunks, write-pending chunks) of the offloader's store."""
    store = off._store
    used = store.num_chunks - store.num_free_chunks - store.num_evictable_chunks
    return used - store.num_write_pending_chunks, store.num_write_pending_chunks


def kv_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(("kv-store", "kv-load"))}


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


class Reports:
    """Counts every job id handed out and every result reported."""

    def __init__(self) -> None:
        self.issued: list[int] = []
        self.seen: Counter[int] = Counter()
        self.results: dict[int, object] = {}

    def issue(self, job: int | None) -> int | None:
        if job is not None:
            assert job not in self.issued, f"job id {job} handed out twice"
            self.issued.append(job)
        return job

    def record(self, results) -> list:
        for r in results:
            self.seen[r.job_id] += 1
            self.results[r.job_id] = r
        return results

    def check_exactly_once(self, context: str = "") -> None:
        lost = [j for j in self.issued if self.seen[j] == 0]
        twice = [j for j, n in self.seen.items() if n > 1]
        foreign = [j for j in self.seen if j not in self.issued]
        assert not lost and not twice and not foreign, (
            f"lost {lost}, reported twice {twice}, never issued {foreign} {context}"
        )


# -- fault injection ---------------------------------------------------------------------

# Every call the offloader and the engine make on the caller's thread that can be
# interrupted from outside: kernels, host copies, the store's bookkeeping, thread queues.
CALLER_TARGETS: list[tuple[object, str]] = [
    (pk, "gather_blocks"),
    (pk.ScatterPlan, "__call__"),  # the engine's scatters (a plan per group)
    (jax, "device_put"),
    (jax, "block_until_ready"),
    (HostStore, "lookup"),
    (HostStore, "prepare_store"),
    (HostStore, "prepare_load"),
    (HostStore, "complete_store"),
    (HostStore, "complete_load"),
    (HostStore, "reset_cache"),
    (ThreadPoolExecutor, "submit"),
]

# The worker threads' host copies.
WORKER_TARGETS: list[tuple[object, str]] = [
    (HostChunkPool, "write_blocks"),
    (HostChunkPool, "read_blocks"),
    (jax, "device_put"),
]


class Injector:
    """Counts calls to `targets` made on the main thread and interrupts call `at`.

    mode "raise": `KeyboardInterrupt` instead of the call (nothing happened).
    mode "signal": the call runs, then a real SIGINT arrives, delivered at the next
    bytecode boundary (the call happened but its caller may never see the result).
    """

    def __init__(self, monkeypatch, targets=CALLER_TARGETS, at: int = 0, mode: str = "raise"):
        self.calls = 0
        self.at = at
        self.mode = mode
        self.fired: str | None = None
        self.names: list[str] = []
        main = threading.main_thread()
        for owner, name in targets:
            real = getattr(owner, name)
            monkeypatch.setattr(owner, name, self._wrap(f"{_name(owner)}.{name}", real, main))

    def arm(self, at: int, mode: str) -> None:
        self.calls, self.at, self.mode, self.fired = 0, at, mode, None

    def disarm(self) -> None:
        self.at = 0

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The test's own checks run uncounted and uninterrupted."""
        at, self.at = self.at, 0
        try:
            yield
        finally:
            self.at = at

    def _wrap(self, name: str, real: Callable, main: threading.Thread) -> Callable:
        def wrapper(*args, **kwargs):
            if threading.current_thread() is not main or not self.at:
                return real(*args, **kwargs)
            self.calls += 1
            self.names.append(name)
            if self.calls != self.at:
                return real(*args, **kwargs)
            self.fired = f"{self.mode} at {name} (call {self.calls})"
            if self.mode == "raise":
                raise KeyboardInterrupt(f"injected before {name}")
            out = real(*args, **kwargs)
            signal.raise_signal(signal.SIGINT)
            return out

        return wrapper


class WorkerFaults:
    """Makes the next `count` worker-thread calls to `targets` raise `error`, or the next
    `slow` ones sleep first (a slow host copy keeps jobs in flight across later steps)."""

    def __init__(self, monkeypatch, targets=WORKER_TARGETS) -> None:
        self.error: BaseException | None = None
        self.count = 0
        self.slow = 0
        self.delay = 0.0
        main = threading.main_thread()
        for owner, name in targets:
            real = getattr(owner, name)
            monkeypatch.setattr(owner, name, self._wrap(real, main))

    def arm(self, error: BaseException | None, count: int = 1) -> None:
        self.error, self.count = error, count

    def slow_down(self, seconds: float, count: int = 1) -> None:
        self.delay, self.slow = seconds, count

    def _wrap(self, real: Callable, main: threading.Thread) -> Callable:
        def wrapper(*args, **kwargs):
            if threading.current_thread() is not main:
                if self.slow > 0:
                    self.slow -= 1
                    time.sleep(self.delay)
                if self.count > 0:
                    self.count -= 1
                    raise self.error
            return real(*args, **kwargs)

        return wrapper


def _name(owner: object) -> str:
    return getattr(owner, "__name__", type(owner).__name__)


@contextmanager
def interruptible() -> Iterator[list[BaseException]]:
    """Runs a step; swallows (and collects) a KeyboardInterrupt it raises."""
    caught: list[BaseException] = []
    try:
        yield caught
    except KeyboardInterrupt as e:
        caught.append(e)


class Gate:
    """Holds worker-thread calls of `owner.name` until `open()` (bounded wait)."""

    def __init__(self, monkeypatch, owner, name: str, times: int = 1) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()
        self.times = times
        real = getattr(owner, name)
        main = threading.main_thread()

        def wrapper(*args, **kwargs):
            if threading.current_thread() is not main and self.times > 0:
                self.times -= 1
                self.entered.set()
                assert self.released.wait(30), "gate never opened"
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    def open(self) -> None:
        self.released.set()

    def open_later(self, seconds: float) -> threading.Timer:
        timer = threading.Timer(seconds, self.released.set)
        timer.start()
        return timer
