"""Our tiers inside vLLM 0.33.0's `TieringOffloadingSpec`, as out-of-tree tiers.

vLLM's `SecondaryTierFactory` imports `module_path` and takes the class named by `type`:

    "secondary_tiers": [
        {"type": "JaxDiskTier", "module_path": "jax_kvoffload.bridge._vllm_tiers",
         "path": "/var/cache/jax-kvoffload", "capacity_bytes": "200GiB"},
        {"type": "JaxRedisTier", "module_path": "jax_kvoffload.bridge._vllm_tiers",
         "url": "redis://cache.internal:6379/0"}
    ]

Every kind of the tier registry has a class here, named by its `TierKind.vllm_class`;
the other keys are the options of its configuration (`DiskTierConfig`,
`RedisTierConfig`, docs/tiers.md), checked by the same parser as our own
`secondary_tiers`. Each tier stores whole rows of vLLM's primary (CPU) tier, one entry
per offload key, in the namespace of the spec's `OffloadingConfig`
(`namespace_digest(..., rank=None)`: a row holds every worker's bytes). vLLM's view of
where the bytes are follows the tier's `medium`: always `Medium.STORAGE`; a "remote"
tier (a shared server) has locality REMOTE and reports hits as `EXTERNAL_UNSPECIFIED`,
a "disk" tier as `DISK`.

Lookups go through vLLM's own `AsyncLookupManager` (the first lookup of a key answers
RETRY while a background thread asks the tier), as vLLM's `fs` tier does. A load that
misses some keys reports the others in `successful_keys` and marks the rest as misses.

Importing this module imports neither vLLM nor torch; the classes are built (and vLLM
imported) on first attribute access.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

from jax_kvoffload._log_once import LogOnce
from jax_kvoffload.config.internals import (
    TierKind,
    TierOptions,
    tier_config_from_dict,
    tier_kind_for_vllm_class,
    tier_kinds,
)
from jax_kvoffload.errors import KVOffloadValueError
from jax_kvoffload.tiers import TierBufferSizeError, tier_class

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import (
        OffloadingSpec,
        OffloadKey,
        ReqContext,
        ScheduleEndContext,
    )
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from jax_kvoffload.tiers import SecondaryTier, TierJobResult

__all__ = [*(k.vllm_class for k in tier_kinds()), "build_tier_classes", "vllm_tier_class"]

logger = logging.getLogger(__name__)


def __getattr__(name: str) -> type:
    kind = tier_kind_for_vllm_class(name)
    if kind is not None:
        return vllm_tier_class(kind)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *(k.vllm_class for k in tier_kinds())})


def build_tier_classes() -> dict[str, type]:
    """`{vllm_class: class}` of every registered kind (vLLM subclasses)."""
    return {k.vllm_class: vllm_tier_class(k) for k in tier_kinds()}


@functools.cache
def vllm_tier_class(kind: TierKind) -> type:
    """The vLLM `SecondaryTierManager` subclass of our tier kind `kind`."""
    from vllm.v1.kv_offload.base import Locality, Medium
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    ours = tier_class(kind)
    remote = ours.medium == "remote"
    attrs: dict[str, object] = {
        "__module__": __name__,
        "__qualname__": kind.vllm_class,
        "__doc__": f"`{ours.__name__}` as a vLLM secondary tier (medium STORAGE"
        + (", a remote store: locality REMOTE)." if remote else ": hits count as disk)."),
        "medium": Medium.STORAGE,
        "_kind": kind,
        "_default_locality": Locality.REMOTE if remote else None,
    }
    if remote:
        attrs["cache_hit_source"] = CacheHitSource.EXTERNAL_UNSPECIFIED
    return type(kind.vllm_class, (_manager_base(),), attrs)


@functools.cache
def _manager_base() -> type:
    """The vLLM `SecondaryTierManager` over one of our tiers, the base of every kind's."""
    from vllm.v1.kv_offload.base import (
        Locality,
        LookupResult,
        OffloadingEvent,
        RequestOffloadingContext,
    )
    from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

    from jax_kvoffload.bridge._vllm_spec import our_offloading_config
    from jax_kvoffload.tiers import namespace_digest, namespace_fields, open_tier

    class _Lookup(AsyncLookupManager):
        def __init__(self, tier: SecondaryTier, tier_type: str) -> None:
            super().__init__(tier_type=tier_type)
            self._tier = tier

        def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> list[bool]:
            return self._tier.contains([bytes(k) for k in keys])

    class _JaxTierManager(SecondaryTierManager):
        """One of our tiers behind vLLM's tiering manager (see the module docstring)."""

        _kind: TierKind  # each kind's subclass (vllm_tier_class) sets these two
        _default_locality: Locality | None = None

        def __init__(
            self,
            offloading_spec: OffloadingSpec,
            primary_kv_view: memoryview,
            tier_type: str,
            backpressure_detector: BackpressureDetector | None = None,
            **options: Any,  # the tier's own options (its entry's other keys), parsed below
        ) -> None:
            super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
            config = cast(  # a kind of ours: its TierOptions subclass
                TierOptions,
                tier_config_from_dict(
                    {"type": self._kind.name, **options}, f"secondary_tiers[type={tier_type!r}]"
                ),
            )
            ours = our_offloading_config(offloading_spec.config)
            self._tier = open_tier(config, namespace_digest(ours), describe=namespace_fields(ours))
            self._rows = primary_kv_view.cast("B")
            self._row_bytes = self.block_size_bytes
            default = self._default_locality
            self.locality = Locality(config.locality) if config.locality else default
            self._events: list[OffloadingEvent] | None = None
            if config.enable_kv_events:
                if offloading_spec.kv_events_config.enable_kv_cache_events:
                    self._events = []
                else:
                    logger.warning(
                        "enable_kv_events is set on tier %r but KV cache events are "
                        "disabled globally; the tier emits none",
                        tier_type,
                    )
            self._jobs: dict[int, tuple[cf.Future[TierJobResult], bool]] = {}  # job: is_load
            self._log_once = LogOnce()  # once per tier, not per process
            self._lookup = _Lookup(self._tier, tier_type)

        def _row(self, chunk_id: int) -> memoryview:
            # Checked: a negative id would slice from the end of the view, i.e. another
            # row's bytes stored (with a valid checksum) under this job's key.
            n = len(self._rows) // self._row_bytes
            if not 0 <= int(chunk_id) < n:
                raise KVOffloadValueError(
                    f"chunk id {chunk_id} is outside the primary tier's rows [0, {n})"
                )
            start = int(chunk_id) * self._row_bytes
            return self._rows[start : start + self._row_bytes]

        def _items(self, job: TransferJob) -> list[tuple[bytes, memoryview]]:
            return [(bytes(k), self._row(c)) for k, c in zip(job.keys, job.chunk_ids, strict=True)]

        def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
            found = self._lookup.lookup(key, req_context)
            if found is None:
                return LookupResult.RETRY
            return LookupResult.HIT if found else LookupResult.MISS

        def submit_store(self, job_metadata: TransferJob) -> None:
            future = self._tier.submit_store(self._items(job_metadata))
            self._jobs[job_metadata.job_id] = (future, False)

        def submit_load(self, job_metadata: TransferJob) -> None:
            future = self._tier.submit_load(self._items(job_metadata))
            self._jobs[job_metadata.job_id] = (future, True)

        def get_finished_jobs(self) -> list[JobResult]:
            results = []
            for job_id, (future, is_load) in list(self._jobs.items()):
                if not future.done():
                    continue
                del self._jobs[job_id]
                try:
                    r = future.result()
                except TierBufferSizeError as e:  # another geometry's entry: misses, kept
                    # Once per tier at WARNING: it recurs every step while the entry stays.
                    self._log_once(
                        logger, "size", "%s: %s; such keys are misses", self.tier_type, e
                    )
                    assert e.result is not None  # internal: set before the future raises
                    r = e.result
                # vLLM's keys, as `_items` gave them (its OffloadKey is a NewType of bytes).
                ok_keys = cast("tuple[OffloadKey, ...]", r.ok_keys)
                if is_load and r.failed_keys:
                    self._lookup.mark_miss(cast("tuple[OffloadKey, ...]", r.failed_keys))
                if not is_load and self._events is not None and ok_keys:
                    self._events.append(
                        OffloadingEvent(
                            keys=list(ok_keys),
                            medium=self.medium,  # type: ignore[arg-type]  # set per kind
                            removed=False,
                            locality=self.locality,
                        )
                    )
                partial = is_load and not r.all_ok and ok_keys
                results.append(
                    JobResult(
                        job_id=job_id,
                        success=r.all_ok,
                        successful_keys=tuple(ok_keys) if partial else None,
                        transfer_time=r.seconds,
                        transfer_bytes=r.nbytes or None,
                    )
                )
            return results

        def has_pending_work(self) -> bool:
            return bool(self._jobs)

        def take_events(self) -> Iterator[OffloadingEvent]:
            if self._events:
                events, self._events = self._events, []
                yield from events

        def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
            return RequestOffloadingContext()

        def on_request_finished(self, req_context: ReqContext) -> None:
            self._lookup.cleanup(req_context.req_id)

        def on_schedule_end(self, context: ScheduleEndContext) -> None:
            self._lookup.flush()

        def drain_jobs(self) -> None:
            # Every tier I/O is bounded (local syscalls, network timeouts), so this ends.
            self._tier.drain()

        def shutdown(self) -> None:
            self._lookup.shutdown()
            self._tier.close()
            self._jobs.clear()
            # vLLM releases the primary view after the tiers: our views must be gone.
            with contextlib.suppress(BufferError):
                self._rows.release()

        @property
        def tier(self) -> SecondaryTier:
            """Our `SecondaryTier` underneath (its `stats()`, for tests and tools)."""
            return self._tier

    return _JaxTierManager
