"""Canonical pages through the secondary tiers, across tensor-parallel sizes.

A JAX engine at TP=2 (global arrays on a mesh of 2 simulated CPU devices) stores a
prefix with `canonical_layout` and `secondary_tiers`; fresh processes at TP=1 and TP=4
(empty host memory, their own meshes) find it in the tier and load it bit for bit. Once
through the disk tier, once through a real 3-primary Redis Cluster.

The tier namespace separates canonical from per-rank entries: an engine without
`canonical_layout` never reads a canonical entry as its own, nor a canonical engine a
per-rank one, whatever the draw of sizes and layouts (seeded; the seed is printed).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload import GroupCaches, KVOffloader
from jax_kvoffload.config import OffloadingConfig
from jax_kvoffload.tiers import namespace_digest
from tests.offloader.test_offloader import BS, NB, D, config, hashes

ROOT = Path(__file__).resolve().parents[2]


def engine(role: str, tp: int, tiers: list[dict], canonical: bool = True) -> dict:
    """One engine process (`_tier_tp_script.py`) on `tp` CPU devices; its JSON report."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.canonical._tier_tp_script", role, str(tp),
         json.dumps(tiers), "1" if canonical else "0"],
        cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def across_tp(tiers: list[dict]) -> None:
    stored = engine("store", 2, tiers)
    assert stored["stored"] and stored["cascaded"] == [3], stored
    for tp in (1, 4):
        got = engine("load", tp, tiers)
        assert got["namespace"] == stored["namespace"], (tp, got)
        assert got["hit"] == 6 and got["loaded"], got
        assert got["promoted"] == [3], got  # from the tier: the host was empty
        assert got["devices"] == [tp, tp], got
        assert got["equal"], f"TP={tp}: the loaded bytes differ from those stored at TP=2"
    # A per-rank (direct) engine of the same model and mesh misses the canonical entries.
    direct = engine("load", 2, tiers, canonical=False)
    assert direct["namespace"] != stored["namespace"]
    assert direct["hit"] == 0 and direct["promoted"] == [0], direct


@pytest.mark.slow  # four engine processes: 25-60 s on the loaded 2-core machine
def test_a_tp2_prefix_loads_at_tp1_and_tp4_through_the_disk_tier(tmp_path):
    across_tp([{"type": "disk", "path": str(tmp_path / "tier"), "capacity_bytes": "64MiB"}])


@pytest.mark.slow  # four engine processes: 25-60 s on the loaded 2-core machine
def test_a_tp2_prefix_loads_at_tp1_and_tp4_through_a_redis_cluster(redis_cluster):
    prefix = f"tp-{uuid.uuid4().hex[:8]}:jkv"  # the session's cluster is shared
    across_tp([{"type": "redis", "url": redis_cluster.url, "cluster": "on", "key_prefix": prefix}])


# -- the namespace: canonical and per-rank entries never mix ------------------------------


def draw(rng: random.Random) -> dict:
    heads = rng.choice([2, 4, 8])
    return {
        "heads": heads,
        "tp": rng.choice([t for t in (1, 2, 4) if t <= heads]),
        "bpc": rng.choice([1, 2]),
        "layout": rng.choice(["nhd", "hnd"]),
    }


def caches_for(d: dict, seed: int) -> GroupCaches:
    shape = (NB, BS, d["heads"], D) if d["layout"] == "nhd" else (NB, d["heads"], BS, D)
    gen = np.random.default_rng(seed)
    arrays = [jnp.asarray(gen.integers(0, 2**16, shape, dtype=np.uint16)) for _ in range(2)]
    return GroupCaches(arrays, getattr(pk.KVLayout, d["layout"])())


def offloader(d: dict, canonical: bool, tier_dir: str, seed: int) -> KVOffloader:
    tiers = [{"type": "disk", "path": tier_dir, "capacity_bytes": "64MiB"}]
    extra = {"secondary_tiers": tiers, **({"canonical_layout": True} if canonical else {})}
    cfg = config(bpc=d["bpc"], extra=extra, heads=d["heads"], tp=d["tp"])
    kw = {"total_kv_heads": d["heads"]} if canonical else {}
    return KVOffloader(cfg, caches_for(d, seed), backend="xla", **kw)


SEED = int(os.environ.get("JKV_TEST_SEED", random.randrange(2**32)))


@pytest.mark.parametrize("first_canonical", [True, False], ids=["canonical-first", "direct-first"])
def test_a_per_rank_engine_and_a_canonical_one_never_read_each_others_entries(
    tmp_path, first_canonical
):
    print(f"seed {SEED} (rerun with JKV_TEST_SEED={SEED})")
    rng = random.Random(f"{SEED}-{first_canonical}")
    for trial in range(3):
        d = draw(rng)
        tier_dir = str(tmp_path / f"tier{trial}")
        prefix = hashes(f"trial{trial}", 4)
        with offloader(d, first_canonical, tier_dir, seed=trial) as writer:
            assert writer.wait([writer.store(prefix, [1, 2, 3, 4])])[0].success
        # The other kind, same model, sizes and layout: a miss, though the bytes are there.
        with offloader(d, not first_canonical, tier_dir, seed=99) as other:
            assert other.lookup(prefix) == 0, (SEED, trial, d)
            assert other.tier_stats[0].promoted == 0
        # The same kind again (a positive control; canonical: at another TP size) hits.
        same = dict(d, tp=rng.choice([t for t in (1, 2, 4) if t <= d["heads"]]))
        if not first_canonical:
            same = d  # per-rank pages are only ever read at their own TP size
        with offloader(same, first_canonical, tier_dir, seed=99) as again:
            assert again.lookup(prefix) == 4, (SEED, trial, d, same)
            assert again.tier_stats[0].promoted == 4 // d["bpc"]


def vllm_config(d: dict, canonical: bool, layout: str | None) -> OffloadingConfig:
    agnostic = d.get("agnostic", True)
    return OffloadingConfig.from_dict(
        {
            "groups": [{"tokens_per_block": 16, "layer_names": ["l0", "l1"], "group_id": 0}],
            "worker_kv_bytes_per_block": 4096 // d["tp"],
            "enable_kv_cache_events": False,
            "extra_config": {"canonical_layout": True} if canonical else {},
            "engine_id": "e",
            "model": {"name": "m", "dtype": "bfloat16"},
            "cache": {"tokens_per_hash": 16, "blocks_per_chunk": d["bpc"]},
            "parallel": {
                "rank": 0, "world_size": d["tp"], "tp_size": d["tp"], "pp_size": 1,
                "pcp_size": 1, "dcp_size": 1, "data_parallel_index": 0,
                "data_parallel_size": 1, "data_parallel_rank_local": None,
                "is_parallelism_agnostic": agnostic,
            },
            "canonical_layout": canonical,
            "kv_cache_layout": layout,
        }
    )  # fmt: skip


def test_vllm_canonical_and_direct_rows_have_different_namespaces():
    # vLLM's scheduler-side rows (rank=None): direct rows hold every worker's slice in rank
    # order, canonical rows the TP=1 page; the same size where heads divide, other bytes.
    print(f"seed {SEED} (rerun with JKV_TEST_SEED={SEED})")
    rng = random.Random(SEED)
    for _ in range(50):
        d = draw(rng)
        layout = rng.choice([None, "LBNHC", "LBHNC"])
        canonical = namespace_digest(vllm_config(d, True, layout))
        for other in (None, "LBNHC", "LBHNC"):
            assert namespace_digest(vllm_config(d, False, other)) != canonical, (SEED, d)
        # Canonical rows are shared across TP sizes (the topology is left out).
        tp = rng.choice([t for t in (1, 2, 4) if t <= d["heads"]])
        assert namespace_digest(vllm_config(dict(d, tp=tp), True, layout)) == canonical


def test_direct_rows_of_several_workers_keep_the_topology():
    # Even where vLLM calls them parallelism-agnostic: the rows of TP=2 and TP=4 direct
    # engines are the same length but other bytes. One worker's rows, canonical rows and
    # replicated ones leave it out.
    print(f"seed {SEED} (rerun with JKV_TEST_SEED={SEED})")
    rng = random.Random(SEED + 1)
    for _ in range(50):
        d = draw(rng)
        layout = rng.choice([None, "LBNHC", "LBHNC"])
        other = dict(d, tp=rng.choice([t for t in (1, 2, 4) if t != d["tp"]]))
        a, b = vllm_config(d, False, layout), vllm_config(other, False, layout)
        assert namespace_digest(a) != namespace_digest(b), (SEED, d, other)
