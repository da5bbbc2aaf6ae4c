"""DiskTier: one checked file per chunk in a private, sharded, crash-safe directory.

Layout: `<path>/<namespace 16 hex>/<shard>/<blake2b(key) hex>.kv`, 256 shard
directories made once, when a namespace is first opened (docs/tiers.md). A store writes
the entry (header block of 4 KiB, then the payload) to a temporary name created 0600
with `O_EXCL | O_NOFOLLOW` and renames it into place; with `fsync=True` the writer hands
the written file to the `Syncer`, which makes whole batches durable (data, rename,
directory) before their stores are reported, so a store reported done survives a crash.
A reader finds no file or a whole one. A file that exists already is a successful
store. Every read checks the header and the payload CRC32C; a file that fails any check
(torn by a crash, truncated, corrupted, another namespace or key) is a miss and is
removed. With direct I/O (probed at start), page-aligned host rows are read and written
in place; other buffers pass through a per-thread aligned staging buffer. The bytes of
one entry file (write, read back, verify) are `_disk_entry.py`'s.

Descriptors: the root and the namespace directory stay open (2 per tier); each I/O
thread holds at most one entry file open at a time, and the syncer one directory.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Mapping, Sequence

from jax_kvoffload._log_once import log_once
from jax_kvoffload._threads import start_threads
from jax_kvoffload.config import DiskTierConfig
from jax_kvoffload.errors import KVOffloadTypeError
from jax_kvoffload.tiers._base import Buffer, SecondaryTier, TierJobResult
from jax_kvoffload.tiers._checks import check_items, check_keys
from jax_kvoffload.tiers._crc import crc32c, warn_if_slow
from jax_kvoffload.tiers._disk_entry import read_entry, write_entry
from jax_kvoffload.tiers._disk_fs import (
    ALIGN,
    StagingBuffer,
    describe_file,
    entry_name,
    exact_mode,
    make_shards,
    open_private_dir,
    open_private_root,
    open_regular,
    probe_direct_io,
    removed_dir,
    tmp_name,
    write_description,
)
from jax_kvoffload.tiers._disk_index import DiskIndex, startup_scan
from jax_kvoffload.tiers._disk_sync import Syncer, then, unlink_quietly
from jax_kvoffload.tiers._entry import encode_header
from jax_kvoffload.tiers._errors import (
    TIER_THREADS,
    DirectIOUnavailableError,
    TierStateError,
    buffer_size_error,
)
from jax_kvoffload.tiers._job_runner import JobRunner, TaskFn, TaskResult

__all__ = ["DiskTier"]

logger = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_FULL = (errno.ENOSPC, errno.EDQUOT)  # the filesystem (or this user's quota) is full
_FULL_MSG = (
    "disk tier at %s: the filesystem is full with %d bytes of entries indexed, below "
    "capacity_bytes=%d: the least recently used entries make room for new ones (lower "
    "capacity_bytes below the free space to avoid the failed writes)"
)
_REMOVED = (
    "disk tier: its directory %s was removed while the tier runs; stores fail and loads "
    "miss (counted in stats().errors) until the tier is reopened (restart the engine)"
)


class DiskTier(SecondaryTier):
    """The local-disk secondary tier (contract: `SecondaryTier`; options: `DiskTierConfig`).

    Args:
      config: the typed options (`path`, `capacity_bytes`, threads, ...).
      namespace: `namespace_digest(offloading_config)`; entries of other namespaces in
        the same directory are never read as this one's.
      describe: optional JSON-ready description of the namespace (e.g.
        `namespace_fields(config)`), written once to `<namespace dir>/namespace.json`
        for operators deciding what to clean up.
    """

    medium = "disk"

    def __init__(
        self,
        config: DiskTierConfig,
        namespace: bytes,
        *,
        describe: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(namespace)
        if not isinstance(config, DiskTierConfig):
            raise KVOffloadTypeError(
                f"config must be a DiskTierConfig, got {type(config).__name__}"
            )
        self.config = config
        warn_if_slow()
        self._root_fd = open_private_root(config.path)
        self._ns_name = namespace[:8].hex()
        self._ns_fd = -1
        self._syncer: Syncer | None = None
        try:
            self._ns_fd, made = open_private_dir(self._root_fd, self._ns_name, config.path)
            if made and config.fsync:
                os.fsync(self._root_fd)
            if make_shards(self._ns_fd, f"{config.path}/{self._ns_name}") and config.fsync:
                os.fsync(self._ns_fd)  # once for all shards, not once per entry
        except OSError as e:  # a full disk, a read-only filesystem
            self._close_fds()
            raise TierStateError(
                f"cannot create the namespace directory {self._ns_name!r} (or its shard "
                f"directories) in the tier "
                f"directory {config.path!r}: {e.strerror or e}"
            ) from None
        except BaseException:  # on any exit: the directory descriptors are closed
            self._close_fds()
            raise
        probed = config.direct_io != "off" and probe_direct_io(self._ns_fd)
        if config.direct_io == "on" and not probed:
            self._close_fds()
            raise DirectIOUnavailableError(
                f"direct_io='on' but the filesystem of {config.path!r} refuses O_DIRECT "
                "(tmpfs, overlayfs and some network filesystems do); use direct_io='auto'"
            )
        self.direct_io = bool(probed)
        if describe is not None:
            write_description(self._ns_fd, describe)
        self._index = DiskIndex(config.capacity_bytes, self._counters)
        self._shard_lock = threading.Lock()
        self._scan_done = threading.Event()  # the start-up scan ended
        self._scan_exited = threading.Event()  # and the delayed sweep after it
        self._scan_stop = threading.Event()
        # None only until the constructor has made it (close() after a failed one).
        self._runner: JobRunner[StagingBuffer] = None  # type: ignore[assignment]
        self._scanner: threading.Thread | None = None
        try:  # threads: one that cannot start stops those before it (out of threads)
            if config.fsync:
                self._syncer = Syncer(self._ns_fd, f"disk-tier-{self._ns_name[:6]}-sync")
            self._runner = JobRunner(
                f"disk-tier-{self._ns_name[:6]}",
                config.read_threads,
                config.write_threads,
                config.max_pending_store_bytes,
                self._counters,
                make_state=lambda kind: StagingBuffer(),
                close_state=lambda buf: buf.close(),
            )
            self._scanner = threading.Thread(
                target=self._rescan, name="disk-tier-rescan", daemon=True
            )
            start_threads([self._scanner], **TIER_THREADS)
        except BaseException:  # on any exit: the threads and descriptors go
            self._scan_exited.set()  # no scanner runs
            self._close_io()
            raise
        logger.info(
            "disk tier at %s: namespace %s, budget %d bytes, %s I/O",
            config.path,
            self._ns_name,
            config.capacity_bytes,
            "direct" if self.direct_io else "buffered",
        )

    # ---- public API --------------------------------------------------------------------

    @staticmethod
    def check_path(path: str) -> None:
        """Makes `path` if missing (0700, its missing parents too) and checks it as
        opening a tier there will: a directory of this user, reachable by no one else,
        not a link (`UnsafeDirectoryError`, `TierStateError`). For a tool that checks its
        arguments before a long start-up (`jax-kvoffload demo --tier disk:PATH`)."""
        os.close(open_private_root(path))

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        keys = check_keys(keys)
        out = []
        for key in keys:
            shard, name = entry_name(self._namespace, key)
            rel = f"{shard}/{name}"
            try:
                st = os.stat(rel, dir_fd=self._ns_fd, follow_symlinks=False)
                hit = describe_file(st) is None
            except OSError:
                hit = False
            out.append(hit)
        self._counters.add(lookups=len(out), lookup_hits=sum(out))
        return out

    def submit_store(self, items: Sequence[tuple[bytes, Buffer]]) -> cf.Future[TierJobResult]:
        self._check_open()
        views = check_items(items, "items")
        self._counters.add(stores_submitted=1)
        tasks = [(i, i + 1, self._store_task(key, view)) for i, (key, view) in enumerate(views)]
        nbytes = sum(len(v) for _, v in views)
        return self._runner.submit("store", [k for k, _ in views], tasks, nbytes)

    def submit_load(self, items: Sequence[tuple[bytes, Buffer]]) -> cf.Future[TierJobResult]:
        self._check_open()
        views = check_items(items, "items", writable=True)
        self._counters.add(loads_submitted=1)
        tasks = [(i, i + 1, self._load_task(i, key, view)) for i, (key, view) in enumerate(views)]
        return self._runner.submit("load", [k for k, _ in views], tasks, 0)

    def drain(self, timeout: float | None = None) -> bool:
        return self._runner.drain(timeout)

    def wait_rescan(self, timeout: float | None = None) -> bool:
        """Waits for the start-up scan of the directory (tests, tools)."""
        return self._scan_done.wait(timeout)

    def _close_io(self) -> None:
        self._scan_stop.set()  # close() does not wait for a long start-up scan
        if self._runner is not None:  # None: the constructor failed before it
            self._runner.close()
        if self._syncer is not None:
            self._syncer.close()  # the stores the runner's threads handed it complete
        self._scan_exited.wait()  # not join() alone: see JobRunner.close
        if self._scanner is not None and self._scanner.ident is not None:
            self._scanner.join()
        self._close_fds()

    def _close_fds(self) -> None:
        # Each forgotten before it is closed: after an interrupted close (Ctrl-C) the
        # next never closes a number again (another file of the process may hold it).
        for name in ("_ns_fd", "_root_fd"):
            fd = getattr(self, name)
            setattr(self, name, -1)
            if fd >= 0:
                os.close(fd)

    # ---- store ---------------------------------------------------------------------------

    def _store_task(self, key: bytes, payload: memoryview) -> TaskFn[StagingBuffer]:
        def run(stage: StagingBuffer) -> TaskResult | cf.Future[TaskResult]:
            done = self._store_one(stage, key, payload)
            if isinstance(done, cf.Future):  # the syncer reports it
                return then(done, lambda r: ([r[0]], r[1]))
            return [done[0]], done[1]

        return run

    def _store_one(
        self, stage: StagingBuffer, key: bytes, payload: memoryview
    ) -> tuple[bool, int] | cf.Future[tuple[bool, int]]:
        """Writes one entry: (stored, bytes written), or its future when the syncer
        makes it durable (`fsync=True`)."""
        shard, name = entry_name(self._namespace, key)
        rel = f"{shard}/{name}"
        n = len(payload)
        total = ALIGN + n
        if total > self._index.capacity_bytes:
            log_once(
                logger,
                "disk-too-big",
                "disk tier: an entry of %d bytes exceeds the "
                "budget capacity_bytes=%d; such chunks are not stored",
                total,
                self._index.capacity_bytes,
            )
            self._counters.add(store_failures=1)
            return False, 0
        try:
            st = os.stat(rel, dir_fd=self._ns_fd, follow_symlinks=False)
        except OSError:
            pass  # absent (or unreadable: the write below says why)
        else:
            kind = describe_file(st)
            if kind is None:
                self._counters.add(keys_already_present=1, keys_stored=1)
                self._index.touch(f"{self._ns_name}/{rel}", st.st_size)
                self._evict(keep=f"{self._ns_name}/{rel}")
                return True, 0
            self._reject(rel, st, kind)  # the rename below could not replace a directory
        tmp = tmp_name(name)
        begun = time.monotonic()
        try:
            try:
                size = self._write_tmp(stage, shard, tmp, key, payload)
            except OSError as e:
                # The filesystem filled up before the budget did: without room made
                # here every later store would fail for good (the budget never asks
                # for an eviction), and the tier would keep only its oldest entries.
                if e.errno not in _FULL or not self._make_room(total, f"{self._ns_name}/{rel}"):
                    raise
                unlink_quietly(self._ns_fd, f"{shard}/{tmp}")
                size = self._write_tmp(stage, shard, tmp, key, payload)  # once more
            if self._syncer is None:
                os.rename(f"{shard}/{tmp}", rel, src_dir_fd=self._ns_fd, dst_dir_fd=self._ns_fd)
        except OSError as e:
            unlink_quietly(self._ns_fd, f"{shard}/{tmp}")
            self._io_error("store", e)
            return False, 0
        if self._syncer is None:
            return self._stored(rel, n, size)
        return then(
            self._syncer.submit(shard, tmp, name, begun),
            lambda err: self._stored(rel, n, size) if err is None else self._failed(err),
        )

    def _write_tmp(
        self, stage: StagingBuffer, shard: str, tmp: str, key: bytes, payload: memoryview
    ) -> int:
        """Writes header + payload to a new file `<shard>/<tmp>`; returns its size."""
        n = len(payload)
        header = encode_header(self._namespace, key, n, crc32c(payload), align=ALIGN)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        if self.direct_io:
            flags |= _O_DIRECT
        try:
            fd = os.open(f"{shard}/{tmp}", flags, 0o600, dir_fd=self._ns_fd)
        except FileNotFoundError:  # the shard was removed under us (an operator's rm -rf)
            self._remake_shards()
            fd = os.open(f"{shard}/{tmp}", flags, 0o600, dir_fd=self._ns_fd)
        try:
            exact_mode(fd, 0o600)
            return write_entry(fd, stage, header, payload, self.direct_io)
        finally:
            os.close(fd)

    def _remake_shards(self) -> None:
        with self._shard_lock:
            made = make_shards(self._ns_fd, f"{self.config.path}/{self._ns_name}")
            if made and self.config.fsync:
                os.fsync(self._ns_fd)

    def _stored(self, rel: str, n: int, size: int) -> tuple[bool, int]:
        self._counters.add(keys_stored=1, bytes_written=n)
        self._index.add(f"{self._ns_name}/{rel}", size)
        self._evict(keep=f"{self._ns_name}/{rel}")
        return True, n

    def _failed(self, err: OSError) -> tuple[bool, int]:
        self._io_error("store", err)
        return False, 0

    # ---- load ----------------------------------------------------------------------------

    def _load_task(self, index: int, key: bytes, out: memoryview) -> TaskFn[StagingBuffer]:
        def run(stage: StagingBuffer) -> TaskResult:
            ok = self._load_one(stage, key, out)
            self._counters.add(load_hits=ok is True, load_misses=ok is not True)
            if ok is True:
                self._counters.add(bytes_read=len(out))
                return [True], len(out)
            if isinstance(ok, int) and ok is not False:  # a whole entry of another length
                return [False], 0, buffer_size_error(index, len(out), ok, self.config.path)
            return [False], 0

        return run

    def _load_one(self, stage: StagingBuffer, key: bytes, out: memoryview) -> bool | int:
        """Loads one entry into `out`: True (a verified hit), False (a miss), or the
        payload length of an entry whose header checks out that `out` does not fit
        (kept)."""
        shard, name = entry_name(self._namespace, key)
        rel = f"{shard}/{name}"
        try:
            fd, st = open_regular(rel, self._ns_fd, _O_DIRECT if self.direct_io else 0)
        except FileNotFoundError:  # evicted (perhaps by another process): out of the budget
            self._index.discard(f"{self._ns_name}/{rel}")
            return False
        except OSError as e:
            self._io_error("load", e)
            return False
        if fd < 0:  # a link, a FIFO, a device, a directory...: never opened, never read
            self._reject(rel, st, describe_file(st) or "not a regular file")
            return False
        try:
            got = read_entry(fd, st, stage, self._namespace, key, out, self.direct_io)
            if isinstance(got, str):  # a bad file: why
                self._reject(rel, st, got)
                return False
            if got is not True:  # a whole entry of another length: kept
                return got
            with contextlib.suppress(OSError):
                os.utime(fd)  # recency for the LRU, kept across restarts
            self._index.touch(f"{self._ns_name}/{rel}", st.st_size)
            self._evict(keep=f"{self._ns_name}/{rel}")  # another process's entry joined
            return True
        except OSError as e:
            self._io_error("load", e)
            return False
        finally:
            os.close(fd)

    def _reject(self, rel: str, st: os.stat_result, reason: str) -> None:
        """Counts a bad entry and removes it (only if the file is still the one read)."""
        self._counters.add(corrupt=1)
        log_once(
            logger,
            "disk-corrupt",
            "disk tier: removed a bad entry (%s) at %s/%s/%s; "
            "further ones are counted in stats().corrupt",
            reason,
            self.config.path,
            self._ns_name,
            rel,
        )
        try:
            now = os.stat(rel, dir_fd=self._ns_fd, follow_symlinks=False)
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                # An empty directory goes too; one holding files is left to its owner.
                remove = os.rmdir if stat.S_ISDIR(now.st_mode) else os.unlink
                remove(rel, dir_fd=self._ns_fd)
        except OSError:
            pass
        self._index.discard(f"{self._ns_name}/{rel}")

    # ---- budget, scan, errors ------------------------------------------------------------

    def _make_room(self, total: int, keep: str) -> bool:
        """Evicts the least recently used entries worth an entry of `total` bytes (and a
        page of slack); False if this tier knows none to evict."""
        used = self._index.used_bytes
        victims = self._index.oldest(-(-total // ALIGN) * ALIGN + ALIGN, keep)
        if not victims:
            return False
        log_once(logger, "disk-full", _FULL_MSG, self.config.path, used, self._index.capacity_bytes)
        self._remove(victims)
        return True

    def _evict(self, keep: str | None = None) -> None:
        self._remove(self._index.over_budget(keep))

    def _remove(self, victims: list[tuple[str, int]]) -> None:
        for rel, size in victims:
            try:
                os.unlink(rel, dir_fd=self._root_fd)
            except FileNotFoundError:
                continue  # gone already (another process evicted it): out of the index
            except OSError as e:
                self._io_error("evict", e)
                continue
            self._counters.add(evictions=1, bytes_evicted=size)

    def _rescan(self) -> None:
        startup_scan(
            self._root_fd,
            self.config,
            self._index,
            self._evict,
            stop=self._scan_stop,
            done=self._scan_done,
            exited=self._scan_exited,
        )

    def _io_error(self, op: str, e: OSError) -> None:
        self._counters.add(errors=1, store_failures=int(op == "store"))
        if e.errno == errno.ENOENT and removed_dir(self._ns_fd):  # an operator's rm -rf
            where = f"{self.config.path}/{self._ns_name}"
            log_once(logger, f"disk-removed-{where}", _REMOVED, where)
            return
        log_once(
            logger,
            f"disk-{op}-{e.errno}",
            "disk tier at %s: %s failed: %s; such "
            "failures are misses / failed stores, counted in stats().errors",
            self.config.path,
            op,
            e,
        )
