"""Checks `KVOffloader` runs on its arguments: hashes, ids, flags, tiers; and the host
tier it assembles from them (`assemble`). Caches against the config: `_cache_checks`.

Each refuses at the call, with the group, the value and the fix, what would otherwise
fail later inside a job (or silently: a float block id truncated to another block).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from jax_kvoffload.assembly import HostTierParts, assemble_host_tier, engine_pages
from jax_kvoffload.config import OffloadingConfig, host_tier_config
from jax_kvoffload.errors import KVOffloadError, KVOffloadTypeError, KVOffloadValueError
from jax_kvoffload.hostmem import HostPoolError
from jax_kvoffload.hostmem.internals import check_indices
from jax_kvoffload.store import KeyNotReadyError
from jax_kvoffload.tiers import SecondaryTier
from jax_kvoffload.transfer import GroupCaches

if TYPE_CHECKING:
    import jax


class OffloaderError(KVOffloadValueError):
    """Bad arguments to a `KVOffloader` call (the message says which and why)."""


def as_group_caches(config: object, caches: object) -> dict[int, GroupCaches]:
    """`caches` as group id -> `GroupCaches` (one `GroupCaches` means the first group)."""
    if not isinstance(config, OffloadingConfig):
        raise KVOffloadTypeError(
            f"config must be an OffloadingConfig (build_offloading_config), got "
            f"{type(config).__name__}"
        )
    if not config.groups:
        raise OffloaderError("config has no offloaded groups: there is nothing to offload")
    if isinstance(caches, GroupCaches):
        return {config.groups[0].group_id: caches}
    if isinstance(caches, (list, tuple)):  # the arrays, in the config's `cache_layout`
        return {config.groups[0].group_id: _named_caches(config, caches)}
    if not isinstance(caches, Mapping):
        raise KVOffloadTypeError(
            f"caches must be a GroupCaches or a mapping group id -> GroupCaches, got "
            f"{type(caches).__name__}; wrap the arrays: GroupCaches(arrays, KVLayout.nhd())"
        )
    out = {}
    for g, gc in caches.items():
        if isinstance(g, bool) or not isinstance(g, (int, np.integer)):
            raise KVOffloadTypeError(f"caches: group ids must be ints, got {g!r}")
        if not isinstance(gc, GroupCaches):
            raise KVOffloadTypeError(
                f"caches[{g}] must be a GroupCaches(arrays, layout), got {type(gc).__name__}"
            )
        out[int(g)] = gc
    return out


def _named_caches(config: OffloadingConfig, arrays: Sequence[jax.Array]) -> GroupCaches:
    """The caller's arrays (`GroupCaches` checks each) in the extra config's `cache_layout`."""
    name = host_tier_config(config.extra_config).cache_layout
    if name is None:  # a list where a GroupCaches goes: the wrong type of argument
        raise KVOffloadTypeError(
            "caches is a list of arrays but kv_connector_extra_config has no 'cache_layout' "
            "to say their layout: set it (e.g. 'cache_layout': 'rpa'), or pass "
            "GroupCaches(arrays, layout)"
        )
    return GroupCaches(list(arrays), name)


def check_hashes(block_hashes: object) -> Sequence[bytes]:
    """`block_hashes` if it is a sequence of bytes (the engine's block hashes)."""
    if isinstance(block_hashes, (str, bytes, bytearray)) or not isinstance(block_hashes, Sequence):
        raise KVOffloadTypeError(
            f"block_hashes must be a sequence of bytes (one hash per block), got "
            f"{type(block_hashes).__name__}"
        )
    for i, h in enumerate(block_hashes):
        if not isinstance(h, (bytes, bytearray)):
            raise KVOffloadTypeError(
                f"block hashes must be bytes, got {type(h).__name__} at block_hashes[{i}]"
            )
    return block_hashes


def check_block_ids(block_ids: object, n_hashes: int, num_blocks: int, group: int) -> np.ndarray:
    """`block_ids` as int64 after the checks a job needs: one per hash, in range."""
    ids = check_indices("block_ids", block_ids)
    if ids.size != n_hashes:
        raise OffloaderError(
            f"block_hashes has {n_hashes} entries but block_ids has {ids.size}; pass one "
            "hash per block"
        )
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        bad = ids[(ids < 0) | (ids >= num_blocks)][0]
        raise OffloaderError(
            f"group {group}: block ids must be in [0, {num_blocks}), got {int(bad)}"
        )
    return ids


def not_loadable(error: Exception, group: int, index: int, tiers: object) -> Exception:
    """`KVOffloader.load`'s error for a chunk it cannot load, in the caller's terms: which
    of their block hashes (by index) and what to call first (never the store's method
    names, nor the key's bytes). Same class as the store's error."""
    where = "the host" if tiers is None else "the host or any secondary tier"
    if isinstance(error, KeyNotReadyError):
        text = (
            f"load: block_hashes[{index}] (group {group}) ends a chunk whose store has not "
            "been collected yet: collect the store job with poll() or wait() first, then "
            "lookup(block_hashes) and load the blocks it counts"
        )
    else:
        text = (
            f"load: block_hashes[{index}] (group {group}) ends a chunk that is not stored in "
            f"{where}: call lookup(block_hashes) first and load only the leading blocks it "
            "counts (block_hashes[:n], block_ids[:n])"
        )
    out = type(error)(text)
    out.key = getattr(error, "key", None)  # type: ignore[attr-defined]
    return out


def check_flag(name: str, value: object) -> bool:
    """`value` if it is a bool (a string such as "no" is truthy: never guessed)."""
    if not isinstance(value, (bool, np.bool_)):
        got = f"{type(value).__name__} {value!r}"
        raise KVOffloadTypeError(f"{name} must be True or False, got {got}")
    return bool(value)


def check_timeout(name: str, value: object) -> float | None:
    """`value` as seconds (None: no bound). NaN is refused: every deadline compared
    with it is false, so a wait would never time out."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise KVOffloadTypeError(
            f"{name} must be a number of seconds or None, got {type(value).__name__} {value!r}"
        )
    seconds = float(value)
    if math.isnan(seconds):
        raise OffloaderError(f"{name}=nan is not a number of seconds; pass None for no bound")
    return seconds


_TIER_MEDIA = ("disk", "remote")


def check_tiers(tiers: object) -> tuple[SecondaryTier, ...]:
    """`tiers` as a tuple (an iterator is read once, here) of `SecondaryTier`s whose
    `medium` says where their bytes are (the tier path's counters are labelled by it)."""
    if isinstance(tiers, (str, bytes)) or not isinstance(tiers, Iterable):
        raise KVOffloadTypeError(
            f"tiers must be a sequence of SecondaryTier objects (open_tier(...)), got "
            f"{type(tiers).__name__}"
        )
    tiers = tuple(tiers)
    for i, tier in enumerate(tiers):
        if not isinstance(tier, SecondaryTier):
            raise KVOffloadTypeError(
                f"tiers[{i}] must be a SecondaryTier (open_tier(...)), got {type(tier).__name__}"
            )
        if tier.medium not in _TIER_MEDIA:
            raise OffloaderError(
                f"tiers[{i}] ({type(tier).__name__}).medium={tier.medium!r}: a secondary tier "
                f"says where its bytes are, one of {_TIER_MEDIA}; set the class attribute"
            )
    return tiers


def budget_error(budget: object, chunk_bytes: int) -> OffloaderError:
    return OffloaderError(
        f"cpu_bytes_to_use={budget!r} buys no chunk: one chunk takes {chunk_bytes} bytes "
        f"of host memory; give at least {chunk_bytes} (better, room for many prompts)"
    )


def assemble(
    config: OffloadingConfig,
    caches: dict[int, GroupCaches],
    cpu_bytes_to_use: int | str | None,
    eviction_policy: str | None,
    host_pool: str | None,
    tiers: Sequence[SecondaryTier] | None,
) -> HostTierParts:
    """Store, pool and tiers, sized as vLLM's CPU tier: a chunk id addresses a row in
    every group. Errors of the parts keep their type family, on our error root."""
    try:
        host = host_tier_config(
            config.extra_config,
            cpu_bytes_to_use=cpu_bytes_to_use,
            eviction_policy=eviction_policy,
            host_pool=host_pool,
        )
        if host.cpu_bytes_to_use is None:
            raise OffloaderError(
                "cpu_bytes_to_use is required: pass it or set it in kv_connector_extra_config"
            )
        if tiers is not None:
            tiers = check_tiers(tiers)
        if (host.secondary_tiers or tiers) and host.store_threshold >= 2:
            raise OffloaderError(
                f"store_threshold={host.store_threshold} is not supported with secondary "
                "tiers (vLLM's TieringOffloadingSpec refuses it too): drop one of them"
            )
        # Global (canonical) arrays hold every rank's bytes in this one process: one copy.
        canonical = config.canonical_layout
        parts = assemble_host_tier(
            config,
            host,
            bytes_per_block={g: gc.block_bytes for g, gc in caches.items()},
            worker_kv_bytes_per_block=sum(gc.block_bytes for gc in caches.values()),
            world_size=1 if canonical else config.parallel.world_size,
            replicated_layout=False if canonical else config.replicated_layout,
            enable_events=config.enable_kv_cache_events,
            tiers=None if tiers is None else tuple(tiers),
            pages=engine_pages(caches),
            accelerator=any(gc.on_accelerator for gc in caches.values()),
        )
    except HostPoolError as e:  # the pool's sizes come from the caller's budget
        raise OffloaderError(
            f"cpu_bytes_to_use={host.cpu_bytes_to_use} with blocks_per_chunk="
            f"{config.cache.blocks_per_chunk}: {e}; lower cpu_bytes_to_use (or "
            "blocks_per_chunk in the extra config)"
        ) from None
    except KVOffloadError:
        raise
    except TypeError as e:  # the store's own checks: their message, our error root
        raise KVOffloadTypeError(str(e)) from e
    except ValueError as e:
        raise OffloaderError(str(e)) from e
    if parts.store.num_chunks < 1:
        for tier in parts.tiers if tiers is None else ():
            tier.close()
        raise budget_error(host.cpu_bytes_to_use, parts.capacity.kv_bytes_per_chunk)
    return parts
