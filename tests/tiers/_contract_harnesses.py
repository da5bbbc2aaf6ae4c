"""The contract suite's harness of each registered tier kind (`_contract.py`): how to
give it a backing, damage one of its entries and stall its stores. A new kind adds its
harness here, under `@contract_harness("<its type>")`."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest

from jax_kvoffload.tiers import SecondaryTier
from jax_kvoffload.tiers._disk_fs import ALIGN, entry_name

from ._contract import TierHarness, contract_harness
from ._helpers import NO_REDIS, REDIS_SERVER, RedisServer
from ._mooncake import NO_MOONCAKE, MooncakeStore


@contract_harness("disk")
class DiskHarness(TierHarness):
    """A private directory; entries are files, so damage is a byte written in one, and a
    stall holds the writer threads before they write."""

    def start(self, tmp_path: str) -> None:
        self.path = os.path.join(tmp_path, "disk-tier")

    def options(self) -> dict:
        return {"path": self.path, "capacity_bytes": "256MiB", "read_threads": 2,
                "write_threads": 2}  # fmt: skip

    def damage(self, tier: SecondaryTier, key: bytes) -> None:
        shard, name = entry_name(tier.namespace, key)
        path = os.path.join(self.path, tier.namespace[:8].hex(), shard, name)
        with open(path, "r+b") as f:
            f.seek(ALIGN)  # the first payload byte, after the header block
            byte = f.read(1)
            f.seek(ALIGN)
            f.write(bytes([byte[0] ^ 0xFF]))

    @contextlib.contextmanager
    def stalled_stores(self, tier: SecondaryTier):
        gate = threading.Event()
        store_one = tier._store_one  # the I/O of one entry, on a writer thread

        def held(*args, **kwargs):
            gate.wait(30)
            return store_one(*args, **kwargs)

        tier._store_one = held
        try:
            yield
        finally:
            gate.set()
            del tier._store_one


@contract_harness("redis")
class RedisHarness(TierHarness):
    """A private redis-server on a loopback port; damage rewrites a value, a stall is the
    server pausing writes (`CLIENT PAUSE ... WRITE`: reads go on)."""

    def start(self, tmp_path: str) -> None:
        if REDIS_SERVER is None:
            pytest.skip(NO_REDIS)
        self.server = RedisServer()

    def stop(self) -> None:
        self.server.stop()

    def options(self) -> dict:
        return {"url": self.server.url, "io_timeout_s": 5.0, "read_connections": 2}

    def damage(self, tier: SecondaryTier, key: bytes) -> None:
        server_key = tier.key_of(key)
        value = bytearray(self.server.call(b"GET", server_key))
        value[-1] ^= 0xFF  # the payload's last byte
        assert self.server.call(b"SET", server_key, bytes(value)) == "OK"

    @contextlib.contextmanager
    def stalled_stores(self, tier: SecondaryTier):
        assert self.server.call(b"CLIENT", b"PAUSE", b"4000", b"WRITE") == "OK"
        try:
            yield
        finally:
            self.server.call(b"CLIENT", b"UNPAUSE")


@contract_harness("mooncake")
class MooncakeHarness(TierHarness):
    """A private Mooncake Store (a master and one storage node) on loopback ports;
    damage rewrites an object through a raw client of Mooncake's own, a stall holds the
    tier's store batches before they reach Mooncake."""

    def start(self, tmp_path: str) -> None:
        if NO_MOONCAKE is not None:
            pytest.skip(NO_MOONCAKE)
        self.store = MooncakeStore()

    def stop(self) -> None:
        self.store.stop()

    def options(self) -> dict:
        return {**self.store.options(), "read_threads": 2, "write_threads": 2}

    def damage(self, tier: SecondaryTier, key: bytes) -> None:
        raw, mkey = self.store.raw, tier.key_of(key)
        value = bytearray(raw.get(mkey))
        value[-1] ^= 0xFF  # the payload's last byte
        assert raw.remove(mkey, True) == 0
        assert raw.put(mkey, bytes(value)) == 0

    @contextlib.contextmanager
    def stalled_stores(self, tier: SecondaryTier):
        gate = threading.Event()
        store_batch = tier._store_batch  # one batch call, on a store thread

        def held(*args, **kwargs):
            gate.wait(30)
            return store_batch(*args, **kwargs)

        tier._store_batch = held
        try:
            yield
        finally:
            gate.set()
            del tier._store_batch
