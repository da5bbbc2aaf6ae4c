"""`demo --two-process --mesh-sizes W,R` and `--tier` with a Redis Cluster.

The writer process runs its engine on a mesh of W CPU devices, the reader on R; the
prefix crosses tensor-parallel sizes as canonical pages through each tier (a disk tier,
a real 3-primary Redis Cluster given by one node, and the same cluster given by several
seed nodes), and the reader's logits equal a full recompute bit for bit. With
`--skip-load` (the negative control) the demo must say it failed and exit 1.
"""

from __future__ import annotations

import json

import pytest

from jax_kvoffload.cli import main
from jax_kvoffload.demo import DemoConfigError, ScenarioConfig, parse_mesh_sizes, tier_entry
from jax_kvoffload.demo._two_process import role_argv, role_env

from .test_demo import SMALL_FLAGS

FEW = [*SMALL_FLAGS, "--decode-tokens", "2"]


def test_a_cluster_tier_is_one_node_url_or_several_seed_nodes():
    assert tier_entry("redis://127.0.0.1:7000") == {
        "type": "redis",
        "url": "redis://127.0.0.1:7000",
    }
    assert tier_entry("redis://10.0.0.1:7000,10.0.0.2:7001,redis://10.0.0.3:7002") == {
        "type": "redis",
        "url": "redis://10.0.0.1:7000",
        "seed_urls": ["redis://10.0.0.2:7001", "redis://10.0.0.3:7002"],
    }
    assert tier_entry("rediss://a:1,b:2")["seed_urls"] == ["rediss://b:2"]


def test_mesh_sizes_are_checked_before_anything_starts(capsys):
    assert parse_mesh_sizes("2,4") == (2, 4)
    for bad in ("2", "2,4,8", "a,b", ""):
        with pytest.raises(DemoConfigError, match="WRITER,READER"):
            parse_mesh_sizes(bad)
    with pytest.raises(DemoConfigError, match="whole heads"):
        ScenarioConfig(mesh_sizes=(3, 2))  # 2 KV heads on 3 devices
    with pytest.raises(DemoConfigError, match="positive"):
        ScenarioConfig(mesh_sizes=(0, 2))
    with pytest.raises(DemoConfigError, match="at most 64"):  # was taken: 10**6 devices
        ScenarioConfig(mesh_sizes=(10**6, 2))
    ScenarioConfig(mesh_sizes=(64, 2))
    assert main(["demo", "--mesh-sizes", "2,4", *FEW]) == 2  # one process: one mesh
    assert "--mesh-sizes needs --two-process" in capsys.readouterr().err
    assert main(["demo", "--two-process", "--tier", "disk:/nonexistent-x/t",
                 "--mesh-sizes", "2,x", *FEW]) == 2  # fmt: skip
    assert "WRITER,READER" in capsys.readouterr().err


def test_each_role_gets_its_own_device_count(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1 --xla_force_host_platform_device_count=9")
    cfg = ScenarioConfig(mesh_sizes=(2, 4), tiers=("disk:/x",))
    assert role_env(cfg, "writer")["XLA_FLAGS"].split() == [
        "--xla_foo=1", "--xla_force_host_platform_device_count=2"
    ]  # fmt: skip
    assert role_env(cfg, "reader")["XLA_FLAGS"].endswith("device_count=4")
    argv = role_argv(cfg, "reader", "disk:/x")
    assert argv[argv.index("--mesh-sizes") + 1] == "2,4"
    assert role_env(ScenarioConfig(tiers=("disk:/x",)), "reader") is None


def run_demo(capsys, *args) -> tuple[int, dict]:
    code = main(["demo", "--two-process", "--json", "--quiet", *args, *FEW])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.slow  # six engine processes: 3.5-4.5 min on the loaded 2-core machine
def test_a_prefix_written_on_2_devices_is_served_on_4_from_disk_and_a_cluster(
    tmp_path, capsys, redis_cluster
):
    ports = redis_cluster.ports
    seeds = ",".join(f"127.0.0.1:{p}" for p in ports[1:3])
    tiers = [f"disk:{tmp_path / 'tier'}", redis_cluster.url, f"{redis_cluster.url},{seeds}"]
    redis_cluster.flush()
    code, s = run_demo(capsys, "--mesh-sizes", "2,4", *[x for t in tiers for x in ("--tier", t)])
    assert code == 0 and s["passed"], json.dumps(s, indent=1)[-3000:]
    assert s["mesh_sizes"] == [2, 4]
    for run in s["runs"]:
        w, r = run["writer"], run["reader"]
        assert (w["mesh_size"], r["mesh_size"]) == (2, 4), run["tier"]
        assert r["prefix_hit_blocks"] == 4 and r["logits_equal"] and r["decode_equal"], run
        assert sum(t["promoted"] for t in r["tiers"]) == 2, run  # from the tier
    spread = [n for n, keys in redis_cluster.keys().items() if keys]
    assert len(spread) > 1, spread  # the keys spread over the primaries


@pytest.mark.slow  # two engine processes: ~1 min on the loaded 2-core machine
def test_the_negative_control_fails_and_exits_1(tmp_path, capsys):
    code, s = run_demo(capsys, "--mesh-sizes", "4,1", "--skip-load",
                       "--tier", f"disk:{tmp_path / 'tier'}")  # fmt: skip
    assert code == 1 and not s["passed"]
    (run,) = s["runs"]
    assert run["reader"]["error"] and not run["reader"]["logits_equal"]
