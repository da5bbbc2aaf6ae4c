"""`KVOffloader` with `secondary_tiers` in its extra config, over real tiers: a disk
directory and a private redis-server (skipped without one).

Block contents are a function of their hash (`tests/faults/_helpers.content`), so any
process can check a loaded block byte for byte."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.faults._helpers import blocks, config, expected, hashes, offloader, pins, write_blocks

from ._helpers import NO_REDIS, REDIS_SERVER, RedisServer


def disk(path) -> dict:
    return {"type": "disk", "path": str(path), "capacity_bytes": "16MiB"}


def store_prompt(tiers, prompt="p", n=8, **kw):
    off = offloader(config(secondary_tiers=tiers, **kw))
    hs = hashes(prompt, n)
    write_blocks(off, list(range(n)), hs)
    assert off.wait([off.store(hs, list(range(n)))])[0].success
    off.close()  # waits for the cascades: the entries are in the tiers now
    return hs


def serve(tiers, hs, seed=5, **kw):
    """A fresh engine: the whole prefix from the tiers, byte for byte."""
    off = offloader(config(secondary_tiers=tiers, **kw), seed=seed)
    try:
        n = off.lookup(hs)
        targets = list(range(16, 16 + n))
        if n:
            assert off.wait([off.load(hs[:n], targets)])[0].success
            np.testing.assert_array_equal(blocks(off, targets), expected(hs[:n]))
        assert pins(off) == (0, 0)
        return n, off.tier_stats
    finally:
        off.close()


@pytest.fixture(scope="module")
def redis_url():
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS)
    server = RedisServer()
    yield server.url
    server.stop()


def test_a_fresh_process_serves_the_prefix_from_the_disk_tier(tmp_path):
    tiers = [disk(tmp_path / "tier")]
    hs = store_prompt(tiers)
    script = textwrap.dedent(f"""
        from tests.tiers.test_offloader_tiers import serve
        from tests.faults._helpers import hashes
        n, stats = serve({tiers!r}, hashes("p", 8))
        print(n, stats[0].promoted)
    """)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["8", "4"]  # 8 blocks, 4 chunks promoted from disk
    assert hs


def test_the_redis_tier_serves_another_engine(redis_url):
    tiers = [{"type": "redis", "url": redis_url, "key_prefix": "jkv-offloader"}]
    hs = store_prompt(tiers, prompt="r")
    n, stats = serve(tiers, hs)
    assert n == 8 and stats[0].promoted == 4 and stats[0].medium == "remote"


def test_disk_then_redis_the_first_tier_holding_a_key_serves_it(tmp_path, redis_url):
    tiers = [disk(tmp_path / "t"), {"type": "redis", "url": redis_url, "key_prefix": "jkv-2"}]
    hs = store_prompt(tiers, prompt="two")
    n, stats = serve(tiers, hs)
    assert n == 8
    assert (stats[0].promoted, stats[1].promoted) == (4, 0)
    assert (stats[0].cascaded, stats[1].cascaded) == (0, 0)  # a promotion is not cascaded


def test_another_model_finds_nothing(tmp_path):
    tiers = [disk(tmp_path / "tier")]
    hs = store_prompt(tiers)
    off = offloader(config(secondary_tiers=tiers, blocks_per_chunk=1), seed=3)
    try:
        assert off.lookup(hs) == 0  # other page geometry: another namespace
    finally:
        off.close()


def test_pinned_rows_cascade_and_promote_the_same_bytes(tmp_path):
    tiers = [disk(tmp_path / "tier")]
    hs = store_prompt(tiers, host_pool="pinned")
    n, _ = serve(tiers, hs, host_pool="pinned")
    assert n == 8


def test_tiers_in_the_extra_config_are_opened_and_closed_by_the_offloader(tmp_path):
    off = offloader(config(secondary_tiers=[disk(tmp_path / "tier")]))
    (tier,) = off.secondary_tiers
    off.close()
    assert tier._closed
    with pytest.raises(Exception, match="only vLLM"):
        offloader(config(secondary_tiers=[{"type": "fs", "root_dir": str(tmp_path)}]))


def test_stats_snapshot_counts_the_tier_path(tmp_path):
    """`KVOffloader.stats().tiers` reads the tier path's counters: 4 chunks cascaded by
    one engine, 4 promoted (and their 8 blocks' tokens counted as hits) by the next."""
    tiers = [disk(tmp_path / "tier")]
    off = offloader(config(secondary_tiers=tiers))
    hs = hashes("s", 8)
    write_blocks(off, list(range(8)), hs)
    assert off.wait([off.store(hs, list(range(8)))])[0].success
    assert off.flush_tiers(timeout=30)
    (written,) = off.stats().tiers
    off.close()
    assert (written.name, written.cascaded, written.promoted, written.failed) == (
        "disk[0]",
        4,
        0,
        0,
    )

    fresh = offloader(config(secondary_tiers=tiers), seed=5)
    try:
        assert fresh.lookup(hs) == 8
        stats = fresh.stats()
        (read,) = stats.tiers
        assert (read.cascaded, read.promoted, read.dropped, read.failed) == (0, 4, 0, 0)
        assert stats.prefix_lookups == 1
        assert stats.prefix_hit_tokens == 8 * fresh.config.groups[0].tokens_per_block
    finally:
        fresh.close()
