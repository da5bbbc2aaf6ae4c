"""The demo with secondary tiers: `--tier disk:PATH` / `--tier redis://...` in one
process, and `--two-process`, where a fresh process serves the first one's prefix from
each tier with logits equal to a full recompute (the Redis parts start their own
redis-server on a free loopback port, and are skipped without one)."""

from __future__ import annotations

import json

import pytest

from jax_kvoffload.cli import main
from jax_kvoffload.demo import (
    DemoConfigError,
    DemoModelConfig,
    ScenarioConfig,
    format_summary,
    run_scenario,
    tier_entry,
)
from tests.tiers._helpers import REDIS_SERVER, RedisServer, free_port

from .test_demo import SMALL, SMALL_FLAGS


@pytest.fixture(scope="module")
def redis_url():
    if REDIS_SERVER is None:
        yield None
        return
    server = RedisServer()
    yield server.url
    server.stop()


def test_tier_values_become_tier_entries():
    assert tier_entry("disk:/var/cache/x") == {
        "type": "disk", "path": "/var/cache/x", "capacity_bytes": "1GiB"
    }  # fmt: skip
    assert tier_entry("redis://127.0.0.1:6379") == {
        "type": "redis",
        "url": "redis://127.0.0.1:6379",
    }
    for bad in ("disk:", "/tmp/x", "http://x", "redis:/x"):
        with pytest.raises(DemoConfigError, match="disk:PATH"):
            ScenarioConfig(tiers=(bad,))


def test_a_password_with_a_comma_is_not_split_into_cluster_seeds():
    # The spec was split at every comma: url "redis://:se" (refused, showing "se" of the
    # password in the error) and a seed "redis://cret@127.0.0.1:6379".
    assert tier_entry("redis://:se,cret@127.0.0.1:6379") == {
        "type": "redis",
        "url": "redis://:se,cret@127.0.0.1:6379",
    }
    assert tier_entry("redis://u:p,w@10.0.0.1:6379,10.0.0.2:6379") == {
        "type": "redis",
        "url": "redis://u:p,w@10.0.0.1:6379",
        "seed_urls": ["redis://10.0.0.2:6379"],
    }


def test_one_process_with_a_disk_tier_cascades_a_and_still_passes(tmp_path):
    cfg = ScenarioConfig(
        model=DemoModelConfig(**SMALL), block_size=8, prompt_blocks=4, suffix_tokens=12,
        decode_tokens=2, tiers=(f"disk:{tmp_path / 'tier'}",),
    )  # fmt: skip
    s = run_scenario(cfg)
    assert s["check"]["passed"] and s["prefix_hit_blocks"] == 4
    (tier,) = s["tiers"]
    assert tier["medium"] == "disk" and tier["cascaded"] >= 2  # A's 2 chunks (and warm-up's)
    # The text summary names the tier and what reached it.
    row = next(ln for ln in format_summary(s).splitlines() if "tier disk:" in ln)
    assert f"{tier['cascaded']} chunks cascaded" in row and "0 failed" in row, row


def test_a_tier_that_refuses_every_store_is_visible_in_the_summary(tmp_path):
    """Nothing listens on the port: the tier fails open (the check still passes), and the
    summary says so instead of looking like a success."""
    cfg = ScenarioConfig(
        model=DemoModelConfig(**SMALL), block_size=8, prompt_blocks=4, suffix_tokens=12,
        decode_tokens=2, tiers=(f"redis://127.0.0.1:{free_port()}",),
    )  # fmt: skip
    s = run_scenario(cfg)
    assert s["check"]["passed"]
    (tier,) = s["tiers"]
    assert tier["cascaded"] == 0 and tier["cascade_failed"] > 0
    row = next(ln for ln in format_summary(s).splitlines() if "tier redis://" in ln)
    assert "0 chunks cascaded" in row and "the warning on stderr says why" in row, row


@pytest.mark.slow  # four engine processes (two tiers): ~27 s on 2 idle cores
def test_two_processes_serve_the_prefix_from_each_tier(tmp_path, capsys, redis_url):
    tiers = ["--tier", f"disk:{tmp_path / 'tier'}"]
    if redis_url is not None:
        tiers += ["--tier", redis_url]
    code = main(["demo", "--two-process", "--json", "--quiet", *tiers, *SMALL_FLAGS])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    assert out["passed"] and len(out["runs"]) == len(tiers) // 2
    for run in out["runs"]:
        w, r = run["writer"], run["reader"]
        assert w["passed"] and w["stored_blocks"] == 4 and w["tiers"][0]["cascaded"] == 2
        # The reader is a fresh process: every prefix block came from the tier.
        assert r["prefix_hit_blocks"] == 4 and r["tiers"][0]["promoted"] == 2
        assert r["logits_equal"] and r["decode_equal"] and r["max_abs_diff"] == 0.0
        assert r["positions_compared"] == 12 and r["ratio"] > 0


def test_two_process_table_and_refusals(tmp_path, capsys):
    assert main(["demo", "--two-process", *SMALL_FLAGS]) == 2
    assert "--two-process needs at least one --tier" in capsys.readouterr().err
    assert main(["demo", "--tier", "nope", *SMALL_FLAGS]) == 2
    assert "disk:PATH" in capsys.readouterr().err
    # A directory another user could read is refused by the disk tier: exit 2, named.
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    assert main(["demo", "--quiet", "--tier", f"disk:{shared}", *SMALL_FLAGS]) == 2
    assert "chmod 700" in capsys.readouterr().err
