"""MooncakeTier: a shared tier on a Mooncake Store (a master and the memory segments its
clients mount), one Mooncake object per chunk.

Key: `<key_prefix>:<namespace 16 hex>:<block hash hex>:<group>`, the Redis tier's; the
master places each object on a segment (its allocation strategy; `replica_num` copies
on distinct ones). Object: the entry header (`_entry.py`) followed by the payload, one
object written whole by one batch put. Rows move without a copy: each key's object is
gathered from two buffers, its header (built in the thread's scratch) and the caller's
row, by `batch_put_from_multi_buffers`, and scattered back the same way by
`batch_get_into_multi_buffers`; the header is then checked and the payload's CRC32C.
A large buffer's exporter (a host pool, vLLM's primary view) is registered with
Mooncake once (`register_buffer`); with RDMA, rows outside registered memory are
staged through the thread's registered scratch.

Failures are misses and failed or dropped stores, never an exception to the caller:
the master not answering marks it down for `retry_after_s` (loads miss and stores drop
at once meanwhile); a segment's node gone is a miss until the master forgets its
objects; no room is a failed store while the master evicts. A damaged entry is removed
and counted. Result codes: `_mooncake_client.py`.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
from collections.abc import Mapping, Sequence

import numpy as np

from jax_kvoffload._log_once import log_once
from jax_kvoffload.config import MooncakeTierConfig
from jax_kvoffload.errors import KVOffloadTypeError
from jax_kvoffload.tiers import _mooncake_client as mc
from jax_kvoffload.tiers._base import Buffer, SecondaryTier, TierJobResult
from jax_kvoffload.tiers._checks import check_items, check_keys
from jax_kvoffload.tiers._crc import crc32c, warn_if_slow
from jax_kvoffload.tiers._entry import check_header, encode_header, header_length
from jax_kvoffload.tiers._errors import TierBufferSizeError, buffer_size_error
from jax_kvoffload.tiers._job_runner import JobRunner, byte_runs

__all__ = ["MooncakeTier", "mooncake_key"]

logger = logging.getLogger(__name__)

_MIN_KEY_BYTES = 4  # the group index is the last 4 bytes (as in the Redis tier)
Items = Sequence[tuple[bytes, memoryview]]  # checked (key, byte view) pairs


def mooncake_key(prefix: str, namespace: bytes, key: bytes) -> str:
    """`<prefix>:<namespace 16 hex>:<block hash hex>:<group index>`."""
    group = int.from_bytes(key[-4:], "big")
    return f"{prefix}:{namespace[:8].hex()}:{key[:-4].hex()}:{group}"


class _Scratch:
    """One thread's scratch memory (headers, staged rows), registered with Mooncake when
    the transport needs it (RDMA); grown on demand."""

    def __init__(self, store: mc.BufferRegistry, register: bool) -> None:
        self._store, self._register = store, register
        self.array = np.empty(0, np.uint8)
        self.addr = 0

    def get(self, nbytes: int) -> np.ndarray:
        if nbytes > self.array.size:
            self.release()
            self.array = np.empty(max(nbytes, 2 * self.array.size, 64 << 10), np.uint8)
            self.addr = self.array.ctypes.data
            if self._register and self._store.register_buffer(self.addr, self.array.size):
                log_once(logger, "mooncake-scratch", "mooncake tier: register_buffer of "
                         "the scratch failed; transfers from it may fail")  # fmt: skip
        return self.array

    def release(self) -> None:
        if self._register and self.array.size:
            self._store.unregister_buffer(self.addr)
        self.array, self.addr = np.empty(0, np.uint8), 0


class MooncakeTier(SecondaryTier):
    """The Mooncake Store secondary tier (contract: `SecondaryTier`; options:
    `MooncakeTierConfig`). Opening it connects to the master and mounts this process's
    segment (`global_segment_size`, 0 for none)."""

    medium = "remote"

    def __init__(
        self,
        config: MooncakeTierConfig,
        namespace: bytes,
        *,
        describe: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(namespace)  # `describe`: the store keeps no file beside entries
        if not isinstance(config, MooncakeTierConfig):
            raise KVOffloadTypeError(
                f"config must be a MooncakeTierConfig, got {type(config).__name__}"
            )
        self.config = config
        warn_if_slow()
        cls = mc.import_store()
        self._where = config.master_server_address
        # Mooncake's setup waits 90 s for a master that does not answer: ask first.
        mc.probe(config.master_address, config.connect_timeout_s, "master_server_address")
        self._store = cls()
        rc = self._store.setup(
            config.local_hostname,
            config.metadata_server,
            config.global_segment_size,
            config.local_buffer_size,
            config.protocol,
            config.device_name or "",
            config.master_server_address,
        )
        if rc == mc.BUFFER_OVERFLOW:  # what setup answers when its memory is refused
            self._store.close()
            raise mc.MooncakeUnavailableError(
                f"Mooncake's client did not start (setup returned {rc}): it could not "
                f"allocate MooncakeTierConfig.global_segment_size="
                f"{config.global_segment_size} / local_buffer_size="
                f"{config.local_buffer_size} bytes; lower them to what this host can spare"
            )
        if rc != 0:
            self._store.close()
            raise mc.MooncakeUnavailableError(
                f"Mooncake's client did not start (setup returned {rc}): master "
                f"{config.master_server_address}, metadata server {config.metadata_server}, "
                f"protocol {config.protocol}; start mooncake_master there (with "
                "--enable_http_metadata_server for an http:// metadata server) or fix "
                "master_server_address / metadata_server"
            )
        self._rdma = config.protocol == "rdma"
        self._replicate = self._replicate_config()
        self._regions = mc.Regions(self._store)
        self._health = mc.MasterHealth(config.retry_after_s, self._counters, self._where)
        self._scratch: list[_Scratch] = []
        try:
            self._runner = JobRunner(
                "mooncake-tier",
                config.read_threads,
                config.write_threads,
                config.max_pending_store_bytes,
                self._counters,
                make_state=lambda kind: self._new_scratch(),
            )
        except BaseException:
            self._store.close()
            raise

    def _replicate_config(self) -> object:
        # Mooncake's `ReplicateConfig` (its package has no types), handed back to it as is.
        from mooncake.store import ReplicateConfig

        rc = ReplicateConfig()
        rc.replica_num = self.config.replica_num
        return rc

    def _new_scratch(self) -> _Scratch:
        s = _Scratch(self._store, self._rdma)
        self._scratch.append(s)
        return s

    def _check_lookup_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        return check_keys(keys, min_bytes=_MIN_KEY_BYTES)

    def key_of(self, key: bytes) -> str:
        """The Mooncake key of an offload key."""
        return mooncake_key(self.config.key_prefix, self._namespace, key)

    def available(self) -> bool:
        """False while the master is considered down (stores are then dropped)."""
        return self._health.up()

    def register_memory(self, buf: Buffer) -> bool:
        """Registers the memory `buf` belongs to (its whole exporter) with Mooncake, so
        rows in it move without staging; large exporters are registered on first use
        anyway. False if Mooncake refused."""
        self._check_open()
        return self._regions.register(buf)

    # ---- public API --------------------------------------------------------------------

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        keys = check_keys(keys, min_bytes=_MIN_KEY_BYTES)
        out = [False] * len(keys)
        if keys and self._health.up():
            codes = self._store.batch_is_exist([self.key_of(k) for k in keys])
            if mc.MASTER_DOWN.intersection(codes):
                self._health.failed()
            else:
                self._health.answered()
            out = [c == 1 for c in codes]
        self._counters.add(lookups=len(out), lookup_hits=sum(out))
        return out

    def submit_store(self, items: Sequence[tuple[bytes, Buffer]]) -> cf.Future[TierJobResult]:
        self._check_open()
        views = check_items(items, "items", min_bytes=_MIN_KEY_BYTES)
        self._counters.add(stores_submitted=1)
        runs = byte_runs([len(v) for _, v in views], self.config.batch_bytes)
        tasks = [(a, b, functools.partial(self._store_batch, views[a:b])) for a, b in runs]
        nbytes = sum(len(v) for _, v in views)
        return self._runner.submit(
            "store", [k for k, _ in views], tasks, nbytes, accept=self._health.up
        )

    def submit_load(self, items: Sequence[tuple[bytes, Buffer]]) -> cf.Future[TierJobResult]:
        self._check_open()
        views = check_items(items, "items", writable=True, min_bytes=_MIN_KEY_BYTES)
        self._counters.add(loads_submitted=1)
        runs = byte_runs([len(v) for _, v in views], self.config.batch_bytes)
        tasks = [(a, b, functools.partial(self._load_batch, views[a:b], a)) for a, b in runs]
        return self._runner.submit("load", [k for k, _ in views], tasks, 0)

    def drain(self, timeout: float | None = None) -> bool:
        return self._runner.drain(timeout)

    def _close_io(self) -> None:
        self._runner.close()
        if self._store is None:
            return
        for s in self._scratch:
            s.release()
        self._regions.close()
        self._store.close()
        self._store = None

    # ---- I/O, on the runner's threads ----------------------------------------------------

    def _buffers(
        self, scratch: _Scratch, items: Items, *, load: bool
    ) -> tuple[list[list[int]], list[list[int]], list[tuple[int, int | None]]]:
        """Per key `[header, row]` addresses and sizes; rows staged in the scratch where
        the transport needs registered memory. Returns (ptrs, sizes, staged rows)."""
        heads = [header_length(len(k)) for k, _ in items]
        addrs = [mc.address_of(v) for _, v in items]
        # Covered: in registered memory (a large exporter is registered here, once).
        covered = [self._regions.covers(v, a) for (_, v), a in zip(items, addrs, strict=True)]
        staged = [self._rdma and not c for c in covered]
        total = sum(heads) + sum(len(v) for (_, v), s in zip(items, staged, strict=True) if s)
        arena = scratch.get(total)
        base, off = scratch.addr, 0
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        rows: list[tuple[int, int | None]] = []
        for (key, view), h, addr, stage in zip(items, heads, addrs, staged, strict=True):
            if not load:
                hdr = encode_header(self._namespace, key, len(view), crc32c(view))
                arena[off : off + h] = np.frombuffer(hdr, np.uint8)
            hp, off = base + off, off + h
            if stage:
                if not load:
                    arena[off : off + len(view)] = np.frombuffer(view, np.uint8)
                addr, off = base + off, off + len(view)
            rows.append((hp - base, addr - base) if stage else (hp - base, None))
            ptrs.append([hp, addr])
            sizes.append([h, len(view)])
        return ptrs, sizes, rows

    def _store_batch(self, items: Items, scratch: _Scratch) -> tuple[list[bool], int]:
        ptrs, sizes, _ = self._buffers(scratch, items, load=False)
        keys = [self.key_of(k) for k, _ in items]
        codes = self._store.batch_put_from_multi_buffers(keys, ptrs, sizes, self._replicate)
        oks = [c == 0 for c in codes]
        if mc.MASTER_DOWN.intersection(codes):
            self._health.failed()
        elif any(oks):
            self._health.answered()
        for c in set(codes) - {0}:
            log_once(logger, f"mooncake-put{c}", "mooncake tier: %s refused a store: %s; "
                     "such stores fail (counted in stats().store_failures)",
                     self._where, mc.code_name(c))  # fmt: skip
        moved = sum(len(v) for (_, v), ok in zip(items, oks, strict=True) if ok)
        self._counters.add(
            keys_stored=sum(oks), store_failures=len(oks) - sum(oks), bytes_written=moved
        )
        return oks, moved

    def _load_batch(
        self, items: Items, first: int, scratch: _Scratch
    ) -> tuple[list[bool], int] | tuple[list[bool], int, TierBufferSizeError]:
        """Loads `items` (the job's from index `first` on): per key verified or not, the
        bytes moved, and the first buffer of the wrong length (a caller's error)."""
        oks = [False] * len(items)
        if not self._health.up():
            self._counters.add(load_misses=len(items))
            return oks, 0
        ptrs, sizes, rows = self._buffers(scratch, items, load=True)
        keys = [self.key_of(k) for k, _ in items]
        codes = self._store.batch_get_into_multi_buffers(keys, ptrs, sizes)
        wrong: dict[int, int] = {}
        arena = scratch.array
        # The master did not answer some key: ask it nothing more (each call would wait
        # its RPC timeout, one key after another).
        lost = bool(mc.MASTER_DOWN.intersection(codes))
        for i, ((key, out), code, (h, n), (hoff, soff)) in enumerate(
            zip(items, codes, sizes, rows, strict=True)
        ):
            if code == h + n:
                if soff is not None:
                    np.frombuffer(out, np.uint8)[:] = arena[soff : soff + n]
                oks[i] = self._verify(keys[i], key, out, arena[hoff : hoff + h])
            elif code in mc.MASTER_DOWN:
                self._health.failed()
            elif code != mc.NOT_FOUND and not lost and self._health.up():
                stored = self._inspect(keys[i], key, h, n, code)
                if stored is not None:
                    wrong[i] = stored
        if not lost and self._health.up():  # (an `_inspect` may have found it down)
            self._health.answered()
        moved = sum(len(out) for (_, out), ok in zip(items, oks, strict=True) if ok)
        self._counters.add(load_hits=sum(oks), load_misses=len(oks) - sum(oks), bytes_read=moved)
        if wrong:
            i, stored = min(wrong.items())
            where = f"the Mooncake store at {self._where}"
            return oks, moved, buffer_size_error(first + i, len(items[i][1]), stored, where)
        return oks, moved

    def _verify(self, mkey: str, key: bytes, out: memoryview, head: np.ndarray) -> bool:
        hdr = check_header(head, namespace=self._namespace, key=key, payload_len=len(out))
        if isinstance(hdr, str):
            reason: str | None = hdr
        else:
            reason = "payload checksum mismatch" if crc32c(out) != hdr.payload_crc else None
        if reason is None:
            return True
        self._bad(mkey, reason)
        return False

    def _bad(self, mkey: str, reason: str) -> None:
        self._counters.add(corrupt=1)
        self._store.remove(mkey, True)  # forced: a reader's lease would keep it
        log_once(logger, "mooncake-corrupt", "mooncake tier: removed a bad entry (%s) at "
                 "%s; further ones are counted in stats().corrupt", reason, mkey)  # fmt: skip

    def _inspect(self, mkey: str, key: bytes, h: int, n: int, code: int) -> int | None:
        """A load that did not fit (`code`): the stored payload length if the entry is
        whole and of another length (kept: the caller's error), else None (a miss; a
        bad entry removed, a transfer failure counted)."""
        size = self._store.get_size(mkey)
        if size in mc.MASTER_DOWN:
            self._health.failed()
        if size < 0:
            return None
        if size == h + n or size > self.config.max_entry_bytes:  # fits: the transfer failed
            self._counters.add(errors=1)
            log_once(logger, f"mooncake-get{code}", "mooncake tier: a load from %s failed: "
                     "%s; such loads miss", self._where, mc.code_name(code))  # fmt: skip
            return None
        scratch = _Scratch(self._store, self._rdma)  # rare: an entry of another length
        try:
            whole = scratch.get(size)
            if self._store.get_into(mkey, scratch.addr, size) != size:
                return None
            hdr = check_header(whole[:size], namespace=self._namespace, key=key)
            if (
                not isinstance(hdr, str)
                and hdr.payload_len == size - hdr.header_len
                and hdr.payload_len != n  # n: a header padded past h (not ours): bad
            ):
                return hdr.payload_len
            self._bad(mkey, hdr if isinstance(hdr, str) else f"an entry of {size} bytes")
            return None
        finally:
            scratch.release()
