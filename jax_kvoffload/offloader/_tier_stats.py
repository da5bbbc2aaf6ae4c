"""The tier path's counters: per secondary tier, what the offloader cascaded, promoted,
dropped and looked up (`KVOffloader.tier_stats`), and the `TierStats` summary of them
that `KVOffloader.stats()` reports. Counted on the offloader's caller thread."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from jax_kvoffload.stats import TierStats
from jax_kvoffload.tiers import TierJobResult
from jax_kvoffload.transfer import Medium, TransferPath

__all__ = ["TierCounts", "TierPathStats"]


@dataclass(frozen=True)
class TierPathStats:
    """Counters of one tier as seen from the offloader (since it was built).

    Keys are chunks (one offload key each); bytes are payload bytes; seconds are the
    summed wall time of the tier's jobs from submission to completion.

    Attributes:
      tier: the tier's index in `secondary_tiers`; medium: "disk" or "remote".
      cascade_path / promotion_path: e.g. "host->disk" / "disk->host".
      cascaded: keys stored in the tier; cascade_dropped: keys the tier refused
        (backpressure, server down); cascade_failed: keys whose store failed.
      promoted: keys loaded into host chunks; promotion_failed: keys that missed or
        failed a check on the way (their host chunks were freed).
      promotion_no_room: promotions refused because the host store had no free or
        evictable chunk.
      lookups / lookup_hits: keys asked for, and found.
    """

    tier: int
    medium: str
    cascade_path: str
    promotion_path: str
    cascade_jobs: int = 0
    cascaded: int = 0
    cascade_dropped: int = 0
    cascade_failed: int = 0
    cascade_bytes: int = 0
    cascade_seconds: float = 0.0
    promotion_jobs: int = 0
    promoted: int = 0
    promotion_failed: int = 0
    promotion_no_room: int = 0
    promotion_bytes: int = 0
    promotion_seconds: float = 0.0
    lookups: int = 0
    lookup_hits: int = 0


_COUNTERS = tuple(f.name for f in fields(TierPathStats) if f.default == 0)


class TierCounts:
    """The counters of every tier of one tier path.

    Args:
      media: each tier's `medium` ("disk" or "remote"), in lookup order.
    """

    def __init__(self, media: Sequence[str]) -> None:
        self._media = tuple(media)
        # ints, and float seconds (each TierPathStats field its own type)
        self._counts: list[dict[str, Any]] = [dict.fromkeys(_COUNTERS, 0) for _ in self._media]

    def add(self, tier: int, counter: str, n: float) -> None:
        """Adds `n` to one of `TierPathStats`' counters of tier `tier`."""
        self._counts[tier][counter] += n

    def job_ended(
        self, tier: int, promotion: bool, result: TierJobResult, good: int, bad: int
    ) -> None:
        """A cascade (or promotion) of tier `tier` ended: `good` keys made it, `bad` not."""
        counts = self._counts[tier]
        if not promotion:
            if result.dropped:
                counts["cascade_dropped"] += good + bad
            else:
                counts["cascaded"] += good
                counts["cascade_failed"] += bad
            counts["cascade_bytes"] += result.nbytes
            counts["cascade_seconds"] += result.seconds
            return
        counts["promoted"] += good
        counts["promotion_failed"] += bad
        counts["promotion_bytes"] += result.nbytes
        counts["promotion_seconds"] += result.seconds

    def stats(self) -> tuple[TierPathStats, ...]:
        """A snapshot per tier (`KVOffloader.tier_stats`)."""
        out = []
        for i, name in enumerate(self._media):
            medium = Medium(name)
            out.append(
                TierPathStats(
                    tier=i,
                    medium=medium.value,
                    cascade_path=str(TransferPath(Medium.HOST, medium)),
                    promotion_path=str(TransferPath(medium, Medium.HOST)),
                    **self._counts[i],
                )
            )
        return tuple(out)

    def summary(self) -> tuple[TierStats, ...]:
        """The per-tier counters of `KVOffloader.stats()` (`OffloadStats.tiers`)."""
        return tuple(
            TierStats(
                f"{s.medium}[{s.tier}]",
                cascaded=s.cascaded,
                promoted=s.promoted,
                dropped=s.cascade_dropped,
                failed=s.cascade_failed + s.promotion_failed,
            )
            for s in self.stats()
        )
