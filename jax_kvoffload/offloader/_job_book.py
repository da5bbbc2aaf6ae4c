"""The job book of `KVOffloader`: every job id it hands out, until reported once.

The offloader owns one; the book is given, when built, the parts a job's end touches:
the host store (its keys are recorded there), the transfer engine (is a job still in
it?), the tier path (a completed store cascades; a load that waited for promotions
takes the keys they pinned for it) and the accounting (each reported job is counted).
Plain code: it runs on the caller's thread, under the offloader's guard, and each
call that changes the book runs inside the offloader's `deferred_interrupts` block.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

from jax_kvoffload.errors import KVOffloadTypeError
from jax_kvoffload.hostmem.internals import check_index
from jax_kvoffload.offloader._accounting import OffloaderAccounting
from jax_kvoffload.offloader._cascade import PromotionWait, TierPath
from jax_kvoffload.offloader._checks import OffloaderError
from jax_kvoffload.store import HostStore, OffloadKey
from jax_kvoffload.transfer import Direction, TransferEngine, TransferResult

__all__ = ["Job", "JobBook"]

logger = logging.getLogger(__name__)


@dataclass
class Job:
    direction: Direction
    group: int
    keys: list[OffloadKey]  # a store's keys; a load's pinned keys (unpinned when it ends)
    generation: int  # the store's; a reset since means the keys are gone
    visible: bool = True  # False: the call that made it raised; settled silently
    # a load's promotions: (tier job, keys)
    waits: list[PromotionWait] = field(default_factory=list)
    released: bool = False  # the store was told (an interrupt after it: not twice)


class JobBook:
    """Records jobs, settles their results with the store, hands them out once.

    Args:
      store: the host store the jobs' keys belong to.
      engine: the transfer engine that runs the jobs.
      tiers: the tier path, or None without secondary tiers.
      accounting: counts every job that ends.
    """

    def __init__(
        self,
        store: HostStore,
        engine: TransferEngine,
        tiers: TierPath | None,
        accounting: OffloaderAccounting,
    ) -> None:
        self._store = store
        self._engine = engine
        self._tiers = tiers
        self._accounting = accounting
        self._jobs: dict[int, Job] = {}  # in flight (engine) or unsettled
        self._unsettled: deque[TransferResult] = deque()  # ended, store not yet told
        self._ready: dict[int, TransferResult] = {}  # settled, not yet returned
        self._ids = itertools.count(1)

    # -- queries --------------------------------------------------------------------------

    @property
    def has_unsettled(self) -> bool:
        """Whether results wait for the store to be told (an interrupted settle)."""
        return bool(self._unsettled)

    def in_engine(self, ids: list[int] | None) -> list[int]:
        """Of `ids` (None: every job), those the engine has not reported yet."""
        waiting = {r.job_id for r in self._unsettled}
        jobs = [i for i in (self._jobs if ids is None else ids) if i in self._jobs]
        return [i for i in jobs if i not in waiting]

    def all_in_generation(self, generation: int) -> bool:
        """Whether every job not yet settled was started in `generation` (none from
        before a reset is left)."""
        return all(j.generation == generation for j in self._jobs.values())

    def check_wait_ids(self, job_ids: object) -> list[int]:
        """`job_ids` as a list, if each is a job not yet reported, listed once."""
        if isinstance(job_ids, (str, bytes)) or not isinstance(job_ids, Iterable):
            raise KVOffloadTypeError(
                f"job_ids must be an iterable of job ids, got {type(job_ids).__name__}"
            )
        ids = [check_index("job id", j) for j in job_ids if j is not None]
        known = [i for i in ids if i in self._ready or self._visible(i)]
        unknown = [i for i in ids if i not in known]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if unknown or dup:
            what = "unknown or already reported" if unknown else "listed twice"
            raise OffloaderError(
                f"job ids {unknown or dup} are {what}; nothing was collected: pass each "
                "job not yet reported once"
            )
        return ids

    def _visible(self, job_id: int) -> bool:
        job = self._jobs.get(job_id)
        return job is not None and job.visible

    # -- a job's life ---------------------------------------------------------------------

    def record(
        self,
        direction: Direction,
        g: int,
        keys: list[OffloadKey],
        waits: Sequence[PromotionWait] = (),
    ) -> int:
        """A new job of `keys` (a store's, or a load's pinned keys); `waits`: a load's
        promotions, as (tier job, keys) pairs. Returns its id."""
        job = next(self._ids)
        self._jobs[job] = Job(direction, g, keys, self._store.cache_generation, waits=list(waits))
        return job

    def abandon(self, job: int) -> None:
        """Undoes a job whose `store` / `load` call raised: the caller never got its id."""
        record = self._jobs[job]
        if self._engine.knows(job):
            # Submitted after all (the interrupt came later): it ends unreported; a
            # load must then not write blocks the caller believes untouched.
            record.visible = False
            if record.direction is Direction.LOAD:
                self._engine.discard(job)
            return
        self._release(record, success=False, job_id=job)
        del self._jobs[job]

    def _release(self, record: Job, success: bool, job_id: int) -> None:
        """Tells the store a job's keys are done with (unless a reset forgot them); a
        stored chunk then cascades to the tiers."""
        if record.waits:
            tiers = cast(TierPath, self._tiers)  # only a tier path gives a job waits
            tiers.process([j for j, _ in record.waits])  # pins the keys it waited for
            record.keys.extend(tiers.release_load(job_id))
        if record.generation != self._store.cache_generation or record.released:
            return
        if record.direction is Direction.STORE:
            self._store.complete_store(record.keys, success=success)
            record.released = True
            if success and self._tiers is not None:
                self._tiers.cascade(record.group, record.keys)
        elif record.keys:
            self._store.complete_load(record.keys)
            record.released = True

    def settle(self, results: list[TransferResult]) -> None:
        """Records ended jobs in the store, then queues the visible ones for the caller.

        Results wait in `_unsettled` until the store has been told: if that is
        interrupted, the next poll / wait / close picks up where this one stopped.
        """
        self._unsettled.extend(results)
        while self._unsettled:
            result = self._unsettled[0]
            record = self._jobs[result.job_id]
            try:
                self._release(record, result.success, result.job_id)
            except Exception:  # the store refused: log it, the job is still reported
                logger.exception("recording job %d in the host store failed", result.job_id)
            self._unsettled.popleft()
            del self._jobs[result.job_id]
            self._accounting.on_job(record.direction is Direction.STORE, result)
            if record.visible:
                self._ready[result.job_id] = result

    def take_ready(self, ids: list[int] | None) -> list[TransferResult]:
        """The settled results of `ids` (None: all), handed out once."""
        if ids is None:
            out = list(self._ready.values())
            self._ready.clear()
            return out
        return [self._ready.pop(i) for i in ids]
