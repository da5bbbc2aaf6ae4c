"""A secondary tier for the fault suite: entries in a dict, faults on demand.

`FakeTier` implements `SecondaryTier` with an in-memory map and worker threads, so a
test can make a promotion miss some keys, fail outright, or stall until it is released;
make a store stall (a cascade in flight) or be dropped (backpressure). Every job's
future still completes exactly once, as the contract demands.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import numpy as np

from jax_kvoffload.tiers import SecondaryTier, TierJobResult


class FakeTier(SecondaryTier):
    medium = "remote"

    def __init__(self, namespace: bytes = bytes(32)) -> None:
        super().__init__(namespace)
        self.entries: dict[bytes, bytes] = {}
        self.lost: set[bytes] = set()  # contains() says yes, a load misses (evicted since)
        self.load_gate: threading.Event | None = None  # loads wait for it
        self.store_gate: threading.Event | None = None  # stores wait for it
        self.load_raises: BaseException | None = None
        self.drop_stores = False
        self.loads_started = threading.Event()
        self.stores_started = threading.Event()
        self._pool = cf.ThreadPoolExecutor(2, thread_name_prefix="fake-tier")
        self._lock = threading.Lock()
        self._inflight: set[cf.Future] = set()

    def contains(self, keys):
        return [bytes(k) in self.entries for k in keys]

    def submit_store(self, items):
        self._check_open()
        keys = tuple(bytes(k) for k, _ in items)
        if self.drop_stores:
            done: cf.Future = cf.Future()
            done.set_result(TierJobResult("store", keys, (False,) * len(keys), dropped=True))
            return done
        data = [(bytes(k), memoryview(b)) for k, b in items]
        return self._submit(self._store, data)

    def submit_load(self, items):
        self._check_open()
        data = [(bytes(k), memoryview(b).cast("B")) for k, b in items]
        return self._submit(self._load, data)

    def _submit(self, fn, data):
        future = self._pool.submit(fn, data)
        with self._lock:
            self._inflight.add(future)
        future.add_done_callback(self._done)
        return future

    def _done(self, future):
        with self._lock:
            self._inflight.discard(future)

    def _store(self, data):
        start = time.monotonic()
        self.stores_started.set()
        if self.store_gate is not None:
            assert self.store_gate.wait(30), "store gate never opened"
        for key, view in data:
            self.entries[key] = bytes(view)  # reads the host row now (pinned meanwhile)
        keys = tuple(k for k, _ in data)
        nbytes = sum(len(v) for _, v in data)
        return TierJobResult("store", keys, (True,) * len(keys), False, nbytes,
                             time.monotonic() - start)  # fmt: skip

    def _load(self, data):
        start = time.monotonic()
        self.loads_started.set()
        if self.load_gate is not None:
            assert self.load_gate.wait(30), "load gate never opened"
        if self.load_raises is not None:
            raise self.load_raises
        ok = []
        for key, out in data:
            hit = key in self.entries and key not in self.lost
            if hit:
                np.frombuffer(out, np.uint8)[:] = np.frombuffer(self.entries[key], np.uint8)
            else:  # a miss leaves garbage behind, as a rejected entry may
                np.frombuffer(out, np.uint8)[:] = 0xAB
            ok.append(hit)
        nbytes = sum(len(v) for (_, v), hit in zip(data, ok, strict=True) if hit)
        keys = tuple(k for k, _ in data)
        return TierJobResult("load", keys, tuple(ok), False, nbytes, time.monotonic() - start)

    def drain(self, timeout=None):
        with self._lock:
            pending = list(self._inflight)
        _done, not_done = cf.wait(pending, timeout=timeout)
        return not not_done

    def _close_io(self):
        self._pool.shutdown(wait=True, cancel_futures=True)
