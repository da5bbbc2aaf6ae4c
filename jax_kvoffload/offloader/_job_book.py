"""The job book of `KVOffloader`: every job id it hands out, until reported once.

A mixin (kept apart to keep modules small); it uses the offloader's attributes named in
its annotations. Runs on the caller's thread, under the offloader's guard.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from jax_kvoffload.errors import KVOffloadTypeError
from jax_kvoffload.offloader._checks import OffloaderError
from jax_kvoffload.store import HostStore
from jax_kvoffload.transfer import Direction, TransferEngine, TransferResult
from jax_kvoffload.transfer.internals import check_index, deferred_interrupts

__all__ = ["JobBook"]

logger = logging.getLogger(__name__)


@dataclass
class Job:
    direction: Direction
    group: int
    keys: list[bytes]  # a store's keys; a load's pinned keys (unpinned when it ends)
    generation: int  # the store's; a reset since means the keys are gone
    visible: bool = True  # False: the call that made it raised; settled silently
    waits: list = field(default_factory=list)  # a load's promotions: (tier job, keys)
    released: bool = False  # the store was told (an interrupt after it: not twice)


class JobBook:
    """Records jobs, settles their results with the store, hands them out once."""

    _store: HostStore
    _engine: TransferEngine
    _tiers: Any  # TierPath | None
    _jobs: dict[int, Job]
    _unsettled: deque[TransferResult]
    _ready: dict[int, TransferResult]
    _ids: Any

    def _check_wait_ids(self, job_ids: object) -> list[int]:
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

    def _record(self, direction: Direction, g: int, keys: list[bytes]) -> int:
        job = next(self._ids)
        self._jobs[job] = Job(direction, g, keys, self._store.cache_generation)
        return job

    def _abandon(self, job: int) -> None:
        """Undoes a job whose `store` / `load` call raised: the caller never got its id."""
        with deferred_interrupts():
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

    def _release(self, record: Job, success: bool, job_id: int | None = None) -> None:
        """Tells the store a job's keys are done with (unless a reset forgot them); a
        stored chunk then cascades to the tiers."""
        if record.waits:
            self._tiers.process([j for j, _ in record.waits])  # pins the keys it waited for
            if job_id is not None:
                self._tiers.release_holder(job_id)
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

    def _pin(self, job_id: int, keys: list[bytes]) -> None:
        """A promotion load `job_id` waited for pinned `keys` for it."""
        self._jobs[job_id].keys.extend(keys)

    def _settle(self, results: list[TransferResult]) -> None:
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
            self._stats.on_job(record.direction is Direction.STORE, result)
            if record.visible:
                self._ready[result.job_id] = result

    def _take_ready(self, ids: list[int] | None) -> list[TransferResult]:
        if ids is None:
            out = list(self._ready.values())
            self._ready.clear()
            return out
        return [self._ready.pop(i) for i in ids]
