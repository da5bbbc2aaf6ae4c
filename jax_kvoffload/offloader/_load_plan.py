"""The plan of a `KVOffloader` load with secondary tiers: which tier holds the keys the
host lacks, and the load's chunks, pins and promotions (through the tier path's queries).

Both run on the offloader's caller thread, under its guard; `prepare_load` runs inside
the offloader's deferred-interrupt block, so its pins and the job's record go together.
"""

from __future__ import annotations

from jax_kvoffload.offloader._cascade import PromotionWait, TierPath
from jax_kvoffload.offloader._checks import OffloaderError
from jax_kvoffload.store import HostStore, LookupResult, OffloadKey

__all__ = ["locate_missing", "prepare_load"]


def locate_missing(tiers: TierPath | None, keys: list[OffloadKey]) -> dict[OffloadKey, int]:
    """The tier holding each key the host lacks (bounded tier calls; none while
    promotions are held after a reset). Changes nothing but the tiers' lookup counts:
    the offloader runs it outside its deferred-interrupt block, interruptible."""
    if tiers is None:
        return {}
    missing = [k for k in keys if tiers.host_state(k) is LookupResult.MISS]
    if not missing or tiers.promotions_held():
        return {}
    return {k: t for k, t in zip(missing, tiers.locate(missing), strict=True) if t is not None}


def prepare_load(
    store: HostStore,
    tiers: TierPath | None,
    g: int,
    keys: list[OffloadKey],
    located: dict[OffloadKey, int],
) -> tuple[list[int], list[OffloadKey], list[PromotionWait]]:
    """Chunk ids of `keys`, the keys pinned now, and the promotions to wait for.

    Keys in the host are pinned; keys a promotion is filling are waited for; keys
    only a tier holds (`located`) are promoted now. A key found nowhere raises the
    store's error before anything changes (as a load of a key not stored always has)."""
    if tiers is None:
        return list(store.prepare_load(keys)), keys, []
    state = [tiers.host_state(k) for k in keys]
    ready = [k for k, st in zip(keys, state, strict=True) if st is not LookupResult.MISS
             and tiers.promotion_of(k) is None]  # fmt: skip
    missing = [k for k, st in zip(keys, state, strict=True) if st is LookupResult.MISS]
    where = [located.get(k) for k in missing]
    nowhere = [k for k, t in zip(missing, where, strict=True) if t is None]
    if nowhere:
        store.prepare_load([*ready, *nowhere])  # raises: not stored
    chunk_of = dict(zip(ready, store.prepare_load(ready), strict=True))
    found = list({k: t for k, t in zip(missing, where, strict=True) if t is not None}.items())
    try:
        started = tiers.promote(g, [k for k, _ in found], [t for _, t in found], protect=ready)
    except BaseException:  # on any exit: no job will unpin them, the caller gets no id
        store.complete_load(ready)
        raise
    if len(started) < len(found):
        store.complete_load(ready)
        raise OffloaderError(
            f"group {g}: {len(found) - len(started)} chunk(s) are in a secondary tier "
            "but the host store has no room to promote them now; call lookup() first "
            "(it promotes what it counts), or load fewer chunks"
        )
    waits: dict[int, PromotionWait] = {}
    for k in keys:
        tier_job = tiers.promotion_of(k)
        if tier_job is not None and k not in chunk_of:
            chunk_of[k] = tier_job.chunks[k]
            waits.setdefault(id(tier_job), (tier_job, []))[1].append(k)
    return [chunk_of[k] for k in keys], ready, list(waits.values())
