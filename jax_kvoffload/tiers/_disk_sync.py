"""Durable renames in batches: the disk tier's group commit (used when `fsync=True`).

A writer thread writes an entry to a temporary file, closes it and hands its name to the
`Syncer`, then takes the next entry at once: the disk keeps receiving data while
earlier entries are made durable. The syncer thread takes every file queued so far and
makes the batch durable in the classic order, only once per batch instead of once per
file:

1. the files' data and metadata reach stable storage: one `syncfs(2)` of the tier's
   filesystem for a batch of two or more files (Linux), else `fdatasync` of each file;
2. each file is renamed to its entry name (a reader finds no file or a whole one);
3. the renames reach stable storage: `syncfs` again, else `fsync` of each shard
   directory touched.

Only then is each store reported (its future resolves), so a store reported done
survives a crash or a power loss.

A failed `syncfs` reports a write-back error of the whole filesystem once (Linux keeps
one error sequence per filesystem and advances it for the descriptor that saw it): the
lost pages may belong to files queued behind the failed batch, or still being written,
and the next `syncfs` would then succeed while their bytes are gone. So every file
whose writing began before the failed call returned is made durable by its own
`fdatasync` (a fresh descriptor of the file still reports its own unseen error), and
only files begun afterwards rely on `syncfs` alone.

A crash before step 3 leaves temporary files (removed at the next start) or renamed
files whose bytes are durable; a torn file is never read as an entry in any case (every
read checks the CRC32C).

Why `syncfs`: every `fdatasync` of a new file is a journal commit and a disk cache
flush; eight writers storing 2 MiB entries spent ~20 % of their time in them on an
ext4 virtio disk, against ~5 % with two `syncfs` per batch. It also writes back other
processes' dirty data on the same filesystem, as a journal commit in ext4's default
`data=ordered` mode does anyway; give the tier a filesystem of its own when that
matters. Store latency grows by up to one batch; the engine never waits for it
(stores beyond `max_pending_store_bytes` are dropped).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import errno
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from types import EllipsisType
from typing import TypeVar, cast

from jax_kvoffload._threads import start_threads
from jax_kvoffload.tiers._disk_fs import describe_file, open_regular
from jax_kvoffload.tiers._errors import TIER_THREADS

T = TypeVar("T")
U = TypeVar("U")

__all__ = ["SYNCFS", "Syncer", "then", "unlink_quietly"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A batch of one file is synced alone (fdatasync + directory fsync): syncfs would also
# write back unrelated dirty data for no gain.
SYNCFS_MIN_FILES = 2


def _load_syncfs() -> Callable[[int], None] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):  # not Linux / not glibc: per-file fsyncs
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int

    def syncfs(fd: int) -> None:  # ctypes releases the GIL around the call
        if fn(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"syncfs: {os.strerror(err)}")

    return syncfs


SYNCFS = _load_syncfs()


class _Item:
    __slots__ = ("begun", "final", "future", "shard", "tmp")

    def __init__(self, shard: str, tmp: str, final: str, begun: float) -> None:
        self.shard = shard
        self.tmp = tmp
        self.final = final
        self.begun = begun  # time.monotonic() before the file was created
        # None once durable and in place, else the OSError that failed it.
        self.future: cf.Future[OSError | None] = cf.Future()


class Syncer:
    """One thread that fsyncs and renames queued temporary files in batches.

    Args:
      ns_fd: the namespace directory; names are `<shard>/<file>` relative to it.
      name: the thread's name.
      syncfs: the batch barrier; by default this module's `SYNCFS` at construction
        (None: per-file and per-directory fsyncs).
    """

    def __init__(
        self, ns_fd: int, name: str, syncfs: Callable[[int], None] | EllipsisType | None = ...
    ) -> None:
        self._ns_fd = ns_fd
        self._syncfs = SYNCFS if syncfs is ... else syncfs
        self._queue: deque[_Item] = deque()
        # When the last failed syncfs returned: files begun before it get their own
        # fdatasync (the failure may have consumed their write-back error).
        self._syncfs_failed_at = float("-inf")
        self._cond = threading.Condition()
        self._stop = False
        self._exited = threading.Event()  # see JobRunner.close: join alone is not enough
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        start_threads([self._thread], **TIER_THREADS)

    def submit(
        self, shard: str, tmp: str, final: str, begun: float | None = None
    ) -> cf.Future[OSError | None]:
        """Queues a written, closed temporary file `<shard>/<tmp>` to become
        `<shard>/<final>` durably; the future resolves to None or the error.

        `begun`: `time.monotonic()` before the file was created (None: unknown, taken
        as before any failure)."""
        item = _Item(shard, tmp, final, float("-inf") if begun is None else begun)
        with self._cond:
            if self._stop:
                item.future.set_result(OSError("the disk tier is closing"))
                unlink_quietly(self._ns_fd, f"{shard}/{tmp}")
                return item.future
            self._queue.append(item)
            self._cond.notify()
        return item.future

    def close(self) -> None:
        """Syncs everything queued, then stops the thread. Idempotent."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._exited.wait()
        self._thread.join()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stop or self._queue)
                    if not self._queue:
                        return  # stopping, and nothing left
                    batch = list(self._queue)
                    self._queue.clear()
                self._sync(batch)
        finally:
            self._exited.set()

    def _sync(self, batch: list[_Item]) -> None:
        errors: dict[int, OSError] = {}
        bug: BaseException | None = None
        try:
            whole = self._syncfs is not None and len(batch) >= SYNCFS_MIN_FILES
            self._barrier_files(batch, whole, errors)
            for i, item in enumerate(batch):
                if i in errors:
                    unlink_quietly(self._ns_fd, f"{item.shard}/{item.tmp}")
                    continue
                try:
                    src, dst = f"{item.shard}/{item.tmp}", f"{item.shard}/{item.final}"
                    os.rename(src, dst, src_dir_fd=self._ns_fd, dst_dir_fd=self._ns_fd)
                except OSError as e:
                    errors[i] = e
                    unlink_quietly(self._ns_fd, f"{item.shard}/{item.tmp}")
            self._barrier_names(batch, whole, errors)
        except BaseException as e:  # a bug: the job runner logs it with its traceback
            bug = e
            for item in batch:  # those not renamed yet: no temporary file left behind
                unlink_quietly(self._ns_fd, f"{item.shard}/{item.tmp}")
        finally:
            for i, item in enumerate(batch):
                if item.future.done():
                    continue
                if bug is not None and i not in errors:
                    item.future.set_exception(bug)  # its store fails, not the others'
                else:
                    item.future.set_result(errors.get(i))

    def _barrier_files(self, batch: list[_Item], whole: bool, errors: dict[int, OSError]) -> None:
        alone: Sequence[int] = range(len(batch))
        if whole:
            try:
                cast(Callable[[int], None], self._syncfs)(self._ns_fd)
            except OSError as e:
                self._syncfs_failed_at = time.monotonic()
                errors.update(dict.fromkeys(range(len(batch)), e))
                return
            # Begun before an earlier syncfs failed: that failure may have been theirs.
            alone = [i for i, item in enumerate(batch) if item.begun < self._syncfs_failed_at]
        for i in alone:
            item = batch[i]
            try:
                # Our own new file, but its name is opened again: nothing else is read.
                fd, st = open_regular(f"{item.shard}/{item.tmp}", self._ns_fd)
                if fd < 0:
                    kind = describe_file(st)
                    raise OSError(errno.EINVAL, f"{item.tmp} is now {kind}, not our entry")
                try:
                    os.fdatasync(fd)
                finally:
                    os.close(fd)
            except OSError as e:
                errors[i] = e

    def _barrier_names(self, batch: list[_Item], whole: bool, errors: dict[int, OSError]) -> None:
        # A rename that is not known durable is reported as a failed store; the file
        # stays (its bytes are whole and checked on every read).
        live = [i for i in range(len(batch)) if i not in errors]
        if not live:
            return
        if whole:
            try:
                cast(Callable[[int], None], self._syncfs)(self._ns_fd)
            except OSError as e:
                self._syncfs_failed_at = time.monotonic()
                errors.update(dict.fromkeys(live, e))
            return
        for shard in dict.fromkeys(batch[i].shard for i in live):
            try:
                fd = os.open(shard, _DIR_FLAGS, dir_fd=self._ns_fd)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as e:
                errors.update({i: e for i in live if batch[i].shard == shard})


def unlink_quietly(dir_fd: int, name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)


def then(future: cf.Future[T], fn: Callable[[T], U]) -> cf.Future[U]:
    """A future of `fn(future.result())`; it always completes (with fn's exception if
    fn raises), so a job waiting on it never hangs."""
    out: cf.Future[U] = cf.Future()

    def done(f: cf.Future[T]) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:  # any failure: the future must complete
            out.set_exception(e)

    future.add_done_callback(done)
    return out
