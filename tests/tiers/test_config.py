"""`secondary_tiers` parsing: vLLM's shape in, frozen dataclasses out, errors that say
which entry, which key, what value and what to do."""

from __future__ import annotations

import pytest

from jax_kvoffload.config.internals import secondary_tiers_from_extra_config
from jax_kvoffload.tiers import (
    DiskTierConfig,
    RedisTierConfig,
    TierConfigError,
    VllmTierConfig,
    open_tier,
    parse_secondary_tiers,
)

BRIDGE = "jax_kvoffload.bridge._vllm_tiers"


def test_our_types_and_vllms_in_one_list():
    tiers = parse_secondary_tiers(
        [
            {"type": "disk", "path": "/d", "capacity_bytes": "2GiB", "direct_io": False},
            {"type": "redis", "url": "redis://u:pw@h:7000/3", "ttl_s": 60, "locality": "remote"},
            {"type": "fs", "root_dir": "/x", "n_read_threads": 4},
            {"type": "MyTier", "module_path": "pkg.mod", "custom": [1, 2]},
        ]
    )
    disk, redis, fs, other = tiers
    assert disk == DiskTierConfig(path="/d", capacity_bytes=2 << 30, direct_io="off")
    assert redis.ttl_s == 60 and redis.locality == "REMOTE"
    assert redis.endpoint == {
        "scheme": "redis",
        "host": "h",
        "port": 7000,
        "path": None,
        "db": 3,
        "username": "u",
        "password": "pw",
    }
    assert fs == VllmTierConfig(type="fs", options={"root_dir": "/x", "n_read_threads": 4})
    assert other.module_path == "pkg.mod" and other.options["custom"] == [
        1,
        2,
    ]  # read back in the caller's types
    assert all(hash(t) is not None for t in tiers[:2])  # frozen and hashable


def test_vllm_out_of_tree_names_parse_as_ours_and_round_trip():
    disk = DiskTierConfig(path="/d", capacity_bytes=10**9, read_threads=12)
    vllm_shape = disk.to_vllm_dict()
    assert vllm_shape == {
        "type": "JaxDiskTier",
        "module_path": BRIDGE,
        "path": "/d",
        "capacity_bytes": 10**9,
        "read_threads": 12,
    }
    assert parse_secondary_tiers([vllm_shape]) == (disk,)
    assert parse_secondary_tiers([disk.to_dict()]) == (disk,)
    redis = RedisTierConfig(url="rediss://h", tls_verify=False, backpressure={"a": 1})
    assert parse_secondary_tiers([redis.to_vllm_dict()]) == (redis,)
    assert secondary_tiers_from_extra_config({"secondary_tiers": [redis.to_dict()]}) == (redis,)
    assert secondary_tiers_from_extra_config({}) == ()


@pytest.mark.parametrize(
    ("value", "where", "words"),
    [
        ({"type": "disk"}, "secondary_tiers", ["must be a list", "wrap one tier"]),
        ("disk", "secondary_tiers", ["must be a list"]),
        ([{"path": "/d"}], "secondary_tiers[0].type", ["is required", "disk"]),
        ([{"type": "dsik"}], "secondary_tiers[0].type='dsik'", ["did you mean 'disk'"]),
        ([{"type": "disk", "capacity_bytes": 1}], "secondary_tiers[0].path", ["is required"]),
        ([{"type": "disk", "path": "/d"}], "secondary_tiers[0].capacity_bytes", ["64GiB"]),
        (
            [{"type": "disk", "path": "/d", "capacity_bytes": "lots"}],
            "secondary_tiers[0].capacity_bytes='lots'",
            ["number of bytes"],
        ),
        (
            [{"type": "disk", "path": "/d", "capacity_bytes": 1, "read_thread": 2}],
            "secondary_tiers[0].read_thread=2",
            ["did you mean 'read_threads'"],
        ),
        (
            [{"type": "disk", "path": "/d", "capacity_bytes": 1, "write_threads": 0}],
            "secondary_tiers[0].write_threads=0",
            ["use 1"],
        ),
        (
            [{"type": "disk", "path": "/d", "capacity_bytes": 1, "direct_io": "yes"}],
            "secondary_tiers[0].direct_io='yes'",
            ['"auto"'],
        ),
        ([{"type": "redis", "url": "http://h"}], "secondary_tiers[0].url", ["rediss://"]),
        ([{"type": "redis", "url": "redis://h:99999"}], "secondary_tiers[0].url", ["port"]),
        ([{"type": "redis", "url": "redis://h/x"}], "secondary_tiers[0].url", ["database"]),
        (
            [{"type": "redis", "url": "redis://h", "tls_ca_file": "/ca"}],
            "secondary_tiers[0].tls_ca_file='/ca'",
            ["rediss://"],
        ),
        (
            [{"type": "redis", "url": "redis://h", "io_timeout_s": 0}],
            "secondary_tiers[0].io_timeout_s=0",
            ["seconds > 0"],
        ),
        (
            [{"type": "disk", "module_path": "x.y", "path": "/d", "capacity_bytes": 1}],
            "secondary_tiers[0].module_path='x.y'",
            ["JaxDiskTier"],
        ),
        ([{"type": "fs", "locality": "near"}], None, None),  # vLLM's own: kept verbatim
        (
            [{"type": "disk", "path": "/d", "capacity_bytes": 1, "locality": "near"}],
            "secondary_tiers[0].locality='near'",
            ["LOCAL"],
        ),
    ],
)
def test_errors_name_entry_key_value_and_fix(value, where, words):
    if where is None:
        parse_secondary_tiers(value)
        return
    with pytest.raises(TierConfigError) as info:
        parse_secondary_tiers(value)
    message = str(info.value)
    assert message.startswith(where), message
    for w in words:
        assert w in message, message
    assert isinstance(info.value, ValueError)


def test_a_password_never_appears_in_an_error():
    with pytest.raises(TierConfigError) as info:
        parse_secondary_tiers([{"type": "redis", "url": "redis://u:hunter2@h:0x/0"}])
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "n"),
    [("123", 123), ("1KiB", 1024), ("1 kb", 1000), ("2GiB", 2 << 30), ("3TB", 3 * 10**12)],
)
def test_sizes(text, n):
    (cfg,) = parse_secondary_tiers([{"type": "disk", "path": "/d", "capacity_bytes": text}])
    assert cfg.capacity_bytes == n


def test_vllms_own_tiers_cannot_be_opened_here():
    (fs,) = parse_secondary_tiers([{"type": "fs", "root_dir": "/x"}])
    with pytest.raises(TierConfigError, match="only vLLM"):
        open_tier(fs, bytes(32))


def test_a_password_in_the_url_never_shows_in_repr_or_str():
    cfg = RedisTierConfig(url="redis://app:s3cret-pw@cache.internal:6380/2")
    for text in (repr(cfg), str(cfg), f"{cfg}", repr([cfg])):
        assert "s3cret-pw" not in text
        assert "redis://app:***@cache.internal:6380/2" in text
    assert cfg.endpoint["password"] == "s3cret-pw"  # still usable by the tier


def test_cluster_options_parse_and_round_trip():
    seeds = ["redis://10.0.0.2:6379", "redis://cache-3.internal"]
    (cfg,) = parse_secondary_tiers(
        [{"type": "redis", "url": "redis://10.0.0.1", "seed_urls": seeds}]
    )
    assert cfg.cluster == "on" and cfg.seed_urls == tuple(seeds)  # seeds mean a cluster
    assert cfg.seed_addresses == (("10.0.0.2", 6379), ("cache-3.internal", 6379))
    assert parse_secondary_tiers([cfg.to_dict()]) == (cfg,)
    assert parse_secondary_tiers([cfg.to_vllm_dict()]) == (cfg,)
    assert RedisTierConfig(url="redis://h").cluster == "auto"
    assert RedisTierConfig(url="redis://h", cluster=True).cluster == "on"
    assert RedisTierConfig(url="unix:///run/r.sock", cluster=False).cluster == "off"
    hash(cfg)  # still a frozen, hashable config


@pytest.mark.parametrize(
    "entry, where, words",
    [
        ({"cluster": "yes"}, "secondary_tiers[0].cluster='yes'", ['"auto", "on" or "off"']),
        ({"seed_urls": "redis://h2"}, "secondary_tiers[0].seed_urls", ["list of URLs"]),
        ({"seed_urls": ["rediss://h2"]}, "secondary_tiers[0].seed_urls", ["redis:// URL"]),
        ({"seed_urls": ["redis://u:pw@h2"]}, "secondary_tiers[0].seed_urls", ["***", "alone"]),
        ({"seed_urls": ["redis://h2/3"]}, "secondary_tiers[0].seed_urls", ["database 0"]),
        ({"seed_urls": ["redis://h2"], "cluster": False}, "secondary_tiers[0].cluster", ["off"]),
        ({"url": "unix:///r.sock", "cluster": "on"}, "secondary_tiers[0].url", ["TCP"]),
        ({"url": "redis://h/2", "cluster": "on"}, "secondary_tiers[0].url", ["database 0"]),
        ({"seed_urls": ["redis://h"] * 65}, "secondary_tiers[0].seed_urls", ["at most 64"]),
    ],
)
def test_cluster_option_errors_name_the_rule(entry, where, words):
    raw = {"type": "redis", "url": "redis://h1", **entry}
    with pytest.raises(TierConfigError) as info:
        parse_secondary_tiers([raw])
    message = str(info.value)
    assert message.startswith(where), message
    assert all(w in message for w in words), message
    assert "pw@" not in message
