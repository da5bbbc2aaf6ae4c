"""The worker-side transfer engine: device KV blocks <-> host chunk rows, asynchronously.

Store: gather kernel into a contiguous staging array (device) -> `jax.device_put` into
host memory (pinned where the platform has it) -> copied into the job's chunk rows.
Load: chunk rows -> staging (host) -> `jax.device_put` to the device -> scatter kernel,
in place. Block counts are split into power-of-two buckets, so each group compiles at
most log2(max_bucket) + 1 shapes per direction.

Threads: kernels are dispatched, and caches replaced, only on the caller's thread (in
`submit_*` and in `get_finished` / `wait`); one worker thread per direction waits for
transfers and touches host memory, so submits return at once. Completion order within
one direction is FIFO, like vLLM's handlers. Across directions, a job never touches a
host row that an earlier job of the other direction still reads or writes: it waits for
that job first (after a reset, a new store may be handed the row an old load still
reads). The life cycle, interrupts and the locking contract: docs/architecture.md.
The jobs, their order, timing and results are the job core's (_job_core.py, shared
with the vLLM bridge's torch worker); the copies themselves (gathers, row reads and
writes, scatters, staging buffers) are in _copies.py. This module checks the calls and
ties the two together.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, cast

import jax

import pallas_kernels as pk
from jax_kvoffload._interrupts import SingleCaller
from jax_kvoffload.config.internals import checked_arguments
from jax_kvoffload.errors import KVOffloadTypeError
from jax_kvoffload.hostmem import HostPool
from jax_kvoffload.hostmem.internals import check_index
from jax_kvoffload.transfer._buckets import bucket_sizes
from jax_kvoffload.transfer._caches import (
    GroupCaches,
    check_arrays,
    check_group_caches,
)
from jax_kvoffload.transfer._copies import FetchedLoad, KernelOptions, StagedCopies
from jax_kvoffload.transfer._errors import TransferError, TransferStateError
from jax_kvoffload.transfer._job_checks import (
    CheckedTransfer,
    check_job_ids,
    check_pool,
    check_transfer,
)
from jax_kvoffload.transfer._job_core import EngineJob, JobCore, JobError
from jax_kvoffload.transfer._job_types import (
    Direction,
    GroupTransfer,
    TransferResult,
    describe_error,
)

__all__ = ["GroupCaches", "TransferEngine"]

logger = logging.getLogger(__name__)


@checked_arguments
class TransferEngine:
    """Moves blocks between device caches and a `HostChunkPool`.

    Contract: driven from one thread at a time (a second thread that calls in while
    another is inside gets `TransferStateError`). Every accepted job (a `submit_*` that
    returned) is reported exactly once, by `get_finished` or `wait`, also across
    `close`. A `submit_*` that raises has queued nothing (validation errors raise
    before anything runs), except when an interrupt (any `BaseException`) arrives just
    as the job is queued: then `knows(job_id)` says whether it was; a known job is
    reported as usual (`discard` it if its result is unwanted).

    Args:
      caches: group id -> `GroupCaches`. The engine owns the arrays from now on: read
        them back with `arrays(group)` after loads (scatters donate the old ones).
      pool: the host rows; `pool.bytes_per_block[g]` must equal the group's block bytes.
      backend, interpret, config: passed to the kernels (`pallas_kernels`).
      max_bucket: largest block count per kernel call (a power of two).
      max_staging_bytes: largest staging array per call; the bucket shrinks (by powers
        of two, down to one block) for groups with large blocks. Tens of MiB per
        `device_put` already run at full PCIe speed, while multi-GiB host allocations
        spend most of their time in page faults (measured on CPU: sys time dominated).
      device_path: take the accelerator's data path on CPU too: stores `device_put`
        their staging into pinned host memory, as on a GPU or TPU (tests count its
        host copies on CPU: tests/transfer/test_host_copies.py).
    """

    def __init__(
        self,
        caches: Mapping[int, GroupCaches],
        pool: HostPool,
        *,
        backend: str = "auto",
        interpret: object = False,
        config: object = None,
        max_bucket: int = 256,
        max_staging_bytes: int = 64 << 20,
        device_path: bool = False,
    ) -> None:
        self._caches = check_group_caches(caches, "TransferEngine")
        max_bucket = check_index("max_bucket", max_bucket)
        max_staging_bytes = check_index("max_staging_bytes", max_staging_bytes)
        try:
            bucket_sizes(0, max_bucket)
        except ValueError as e:
            raise TransferError(str(e)) from None
        if max_staging_bytes < 1:
            raise TransferError(f"max_staging_bytes={max_staging_bytes} must be >= 1")
        check_pool(pool)
        names = ("auto", *(b.name for b in pk.list_backends()))  # with registered ones
        if not isinstance(backend, str) or backend not in names:
            raise TransferError(f"backend must be one of {names}, got {backend!r}")
        if backend != "auto" and not interpret:
            # Refused now, not at the first job: a job failing for a reason fixed at
            # construction would only surface as failed stores.
            for g, gc in self._caches.items():
                device = next(iter(gc.arrays[0].devices()))
                if not pk.get_backend(backend).supports(device):
                    runs = ("auto", *pk.supported_backends(device))
                    raise TransferError(
                        f"backend={backend!r} does not run on group {g}'s caches "
                        f"({device.platform}); use one of {runs}, or interpret=True"
                    )
        for g, gc in self._caches.items():
            want = pool.bytes_per_block.get(g)
            if want != gc.block_bytes:
                raise TransferError(
                    f"group {g}: the host pool holds {want} bytes per block but the caches "
                    f"have {gc.block_bytes}; size the pool from the caches"
                )
        self._pool = pool
        kernel_kw: KernelOptions = {"backend": backend, "interpret": interpret, "config": config}
        self._copies = StagedCopies(
            self._caches,
            pool,
            kernel_kw,
            max_bucket,
            max_staging_bytes,
            device_path=bool(device_path),
        )
        self._guard = SingleCaller("TransferEngine", TransferStateError)
        self._jobs: JobCore[TransferResult] = JobCore(
            {d.value: d for d in Direction},
            self._result,
            finish=self._finish,
            release=self._release,
        )

    # -- public API -----------------------------------------------------------------

    def arrays(self, group: int) -> list[jax.Array]:
        """The group's current device arrays (replaced by every completed load)."""
        with self._guard:
            return list(self._group(group).arrays)

    def set_arrays(self, group: int, arrays: Sequence[jax.Array]) -> None:
        """Replaces the group's device arrays (e.g. after the engine's own prefill wrote
        K/V). Same count, shapes and dtypes as now; call on the caller's thread, after
        reading back `arrays(group)` following any completed load."""
        with self._guard:
            gc = self._group(group)
            arrays = check_arrays(arrays, gc.layout, f"set_arrays(group={group})")
            gc.check_replacement(arrays, f"group {group}")
            gc.arrays = arrays

    def submit_store(self, job_id: int, transfers: Sequence[GroupTransfer]) -> None:
        """Starts copying the blocks to their chunk rows; returns at once."""
        with self._guard:
            checked = self._check(job_id, transfers)
            size = sum(len(t.block_ids) * self._caches[t.group].block_bytes for t in checked)
            chunks = frozenset(c for t in checked for c in t.chunk_ids)
            try:
                staged = self._copies.gather(checked)
            except Exception as exc:  # e.g. device memory exhausted: the job fails, reported
                self._jobs.fail(job_id, "store", exc, size)
                return
            write = functools.partial(self._copies.write, staged)
            self._jobs.submit(job_id, "store", write, size, rows=chunks)

    def submit_load(
        self,
        job_id: int,
        transfers: Sequence[GroupTransfer],
        *,
        after: Sequence[Future[Any]] = (),  # any result: only their end is waited for
        check: Callable[[], None] | None = None,
        inline: bool = False,
    ) -> None:
        """Starts copying chunk rows back into the blocks; caches change on completion.

        `after`: futures (e.g. promotions filling the rows) the job waits for before it
        reads the rows; then `check()`, if given, runs on the worker and fails the job
        by raising (e.g. a promotion that missed a key the job needs).
        `inline`: for a small load the caller waits for at once (a synchronous engine
        step): when it has nothing to wait for (no `after`, no job of the other
        direction on its rows, no earlier load still running), its rows are read and
        put on the devices here, with SIGINT held, before this returns; it is completed
        and reported as any load."""
        with self._guard:
            checked = self._check(job_id, transfers, unique=True)
            plan = self._copies.load_plan(checked)
            size = sum(len(t.block_ids) * self._caches[t.group].block_bytes for t in checked)
            chunks = frozenset(c for t in checked for c in t.chunk_ids)
            load = FetchedLoad()
            fetch = functools.partial(self._copies.fetch, plan, load, settle=not inline)
            work: Callable[[], None] = fetch
            if check is not None:

                def work() -> None:
                    check()
                    fetch()

            self._jobs.submit(
                job_id, "load", work, size, rows=chunks, after=after, payload=load, inline=inline
            )

    def get_finished(self) -> list[TransferResult]:
        """Results of the jobs that ended since the last call; never blocks."""
        with self._guard:
            return self._jobs.collect()

    def has_finished(self) -> bool:
        """Whether `get_finished` would return anything now (cheap; never blocks)."""
        with self._guard:
            return self._jobs.has_finished()

    def join(self, job_ids: Iterable[int] | None = None) -> None:
        """Blocks until the transfers of the given jobs (default: all) ended, without
        collecting them (`get_finished` / `wait` then return at once). Interruptible."""
        with self._guard:
            self._jobs.join(None if job_ids is None else self._check_ids(job_ids))

    def wait(self, job_ids: Iterable[int]) -> list[TransferResult]:
        """Blocks until the given jobs end; returns their results (in the given order).

        Every id must be a job that is in flight or ended uncollected, listed once;
        otherwise `TransferError` is raised before anything is collected or waited for.
        """
        with self._guard:
            return self._jobs.wait(self._check_ids(job_ids))

    def knows(self, job_id: int) -> bool:
        """Whether `job_id` is a job that will be (or can now be) reported."""
        with self._guard:
            return self._jobs.knows(job_id)

    def discard(self, job_id: int) -> None:
        """Gives up a job in flight: it ends as failed, a load never writes its blocks,
        and a store that has not started yet never runs. It is still reported once."""
        with self._guard:
            if not self._jobs.discard(check_index("job_id", job_id)):
                raise TransferError(f"job {job_id} is not in flight")

    @property
    def in_flight(self) -> int:
        """Jobs whose transfer or completion is outstanding."""
        return self._jobs.num_in_flight

    @property
    def closed(self) -> bool:
        return self._jobs.closed

    def close(self) -> None:
        """Waits for every job in flight, completes it, then stops the worker threads.

        Results of jobs that ended stay available to `get_finished` / `wait`.
        Idempotent; if interrupted while waiting, call it again.
        """
        with self._guard:
            self._jobs.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals: submitting --------------------------------------------------------

    def _group(self, group: object) -> GroupCaches:
        g = check_index("group", group)
        if g not in self._caches:
            raise TransferError(f"unknown group {g}; groups are {sorted(self._caches)}")
        return self._caches[g]

    def _check(
        self, job_id: object, transfers: object, unique: bool = False
    ) -> list[CheckedTransfer]:
        if self._jobs.closing:
            raise TransferStateError("the transfer engine is closed; build a new one")
        job_id = check_index("job_id", job_id)
        if self._jobs.knows(job_id):
            raise TransferError(f"job id {job_id} is already in use")
        if not isinstance(transfers, (list, tuple)):
            raise KVOffloadTypeError(
                f"transfers must be a list of GroupTransfer, got {type(transfers).__name__}"
            )
        return [self._check_transfer(i, t, unique) for i, t in enumerate(transfers)]

    def _check_transfer(self, i: int, t: object, unique: bool) -> CheckedTransfer:
        return check_transfer(i, t, self._caches, self._pool, unique)

    def _check_ids(self, job_ids: object) -> list[int]:
        return check_job_ids(job_ids, self._jobs.knows)

    # -- internals: completing (caller's thread, called by the job core) ----------------

    def _finish(self, job: EngineJob) -> Exception | None:
        """Scatters a load's fetched pieces (SIGINT held: the job core's completion step).
        A `BaseException` out of a scatter leaves the job in flight with its progress
        kept; the next completion resumes it."""
        if job.direction is Direction.LOAD:
            return self._copies.scatter(cast(FetchedLoad, job.payload))  # submit_load's
        return None

    @staticmethod
    def _release(job: EngineJob) -> None:
        # Free a load's staging (job-sized) now, even if a traceback holds its pieces.
        load = cast("FetchedLoad | None", job.payload)  # a load's (submit_load), else None
        if load is not None:
            load.pieces.clear()

    @staticmethod
    def _result(job: EngineJob, error: JobError, seconds: float) -> TransferResult:
        if error is not None and not job.discarded:
            logger.warning(
                "transfer job %d (%s) failed: %r", job.job_id, job.direction.value, error
            )
        return TransferResult(
            job_id=job.job_id,
            direction=job.direction,
            success=error is None,
            size_bytes=job.size_bytes,
            seconds=seconds,
            error=describe_error(error),
        )
