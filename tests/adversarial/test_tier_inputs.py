"""Bad input at the tiers' public entries: the typed configurations built directly (as
docs/tiers.md shows), `parse_secondary_tiers`, `open_tier`, and the tier methods. Every
mistake is an error of the library's root naming the key and the value, raised at once:
never a raw ValueError/OSError/TypeError from deep inside, never a tier that accepts a
job and never finishes it."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jax_kvoffload.errors import KVOffloadError, KVOffloadTypeError
from jax_kvoffload.tiers import (
    DiskTier,
    DiskTierConfig,
    RedisTier,
    RedisTierConfig,
    TierConfigError,
    TierKeyError,
    TierStateError,
    open_tier,
    parse_secondary_tiers,
)

NS = bytes(range(32))


def disk_kw(tmp_path, **kw):
    return {"path": str(tmp_path / "tier"), "capacity_bytes": 1 << 20, **kw}


DISK_BAD = {
    "no read thread": {"read_threads": 0},  # loads would queue forever
    "no write thread": {"write_threads": 0},
    "a million threads": {"read_threads": 10**6},
    "threads 1.5": {"read_threads": 1.5},
    "negative budget": {"capacity_bytes": -5},
    "budget None": {"capacity_bytes": None},
    "pending 0": {"max_pending_store_bytes": 0},
    "direct_io bogus": {"direct_io": "bogus"},
    "fsync 'yes'": {"fsync": "yes"},
    "rescan inf": {"rescan_timeout_s": float("inf")},
    "rescan nan": {"rescan_timeout_s": float("nan")},
    "rescan 'x'": {"rescan_timeout_s": "x"},
    "path empty": {"path": ""},
    "path NUL": {"path": "a\0b"},
    "locality 'near'": {"locality": "near"},
    "backpressure list": {"backpressure": [1]},
    "events 1": {"enable_kv_events": 1},
}


@pytest.mark.parametrize("name", sorted(DISK_BAD))
def test_a_disk_config_built_directly_is_checked(tmp_path, name):
    with pytest.raises(TierConfigError) as info:
        DiskTierConfig(**disk_kw(tmp_path, **DISK_BAD[name]))
    key = next(iter(DISK_BAD[name]))
    assert key in str(info.value), info.value


def test_a_disk_config_built_directly_reads_sizes_as_the_parser_does(tmp_path):
    cfg = DiskTierConfig(path=str(tmp_path), capacity_bytes="2GiB", locality="local")
    assert cfg.capacity_bytes == 2 << 30 and cfg.locality == "LOCAL"
    assert cfg == parse_secondary_tiers([{"type": "disk", **cfg.to_dict()}])[0]
    assert DiskTierConfig(path="/d", capacity_bytes=np.int64(4096)).capacity_bytes == 4096


def test_a_tier_without_read_threads_never_takes_a_job(tmp_path):
    # Before: the config was accepted and every load future stayed pending forever.
    with pytest.raises(TierConfigError, match="read_threads"):
        DiskTier(DiskTierConfig(**disk_kw(tmp_path, read_threads=0)), NS)


REDIS_BAD = {
    "url garbage": {"url": "garbage"},
    "url bad IPv6": {"url": "redis://[::1"},
    "url port 0": {"url": "redis://h:0"},
    "url db ²": {"url": "redis://h/²"},
    "no connection": {"read_connections": 0},
    "io timeout inf": {"io_timeout_s": float("inf")},
    "io timeout 1e13": {"io_timeout_s": 1e13},
    "connect timeout 0": {"connect_timeout_s": 0},
    "retry -1": {"retry_after_s": -1},
    "ttl 0": {"ttl_s": 0},
    "ttl 1.5": {"ttl_s": 1.5},
    "prefix with space": {"key_prefix": "a b"},
    "prefix empty": {"key_prefix": ""},
    "batch 0": {"batch_bytes": 0},
    "tls without rediss": {"tls_ca_file": "/ca.pem"},
    "tls_verify 'no'": {"url": "rediss://h", "tls_verify": "no"},
    "password_env 5": {"password_env": 5},
}


@pytest.mark.parametrize("name", sorted(REDIS_BAD))
def test_a_redis_config_built_directly_is_checked(name):
    kw = {"url": "redis://127.0.0.1:6379/0", **REDIS_BAD[name]}
    with pytest.raises(TierConfigError):
        RedisTierConfig(**kw)


PARSE_BAD = {
    "bad IPv6 URL": {"type": "redis", "url": "redis://[::1"},
    "port 0": {"type": "redis", "url": "redis://h:0"},
    "db ²": {"type": "redis", "url": "redis://h/²"},
    "infinite io timeout": {"type": "redis", "url": "redis://h", "io_timeout_s": float("inf")},
    "io timeout past time_t": {"type": "redis", "url": "redis://h", "io_timeout_s": 1e13},
    "5000-digit size": {"type": "disk", "path": "/d", "capacity_bytes": "9" * 5000},
    "NUL in path": {"type": "disk", "path": "a\0b", "capacity_bytes": 4096},
    "a million connections": {"type": "redis", "url": "redis://h", "read_connections": 10**6},
}


@pytest.mark.parametrize("name", sorted(PARSE_BAD))
def test_parse_secondary_tiers_refuses_with_a_tier_config_error(name):
    # Before: raw ValueError ("Invalid IPv6 URL", "Exceeds the limit (4300 digits)"),
    # or accepted (port 0 silently became 6379; infinite timeouts; a NUL in a path).
    with pytest.raises(TierConfigError) as info:
        parse_secondary_tiers([PARSE_BAD[name]])
    assert info.value.where == "secondary_tiers[0]"


def test_unreadable_tls_files_are_a_config_error(tmp_path):
    # Before: a raw FileNotFoundError / ssl.SSLError from open_tier.
    missing = str(tmp_path / "missing.pem")
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    for key, value in (("tls_ca_file", missing), ("tls_ca_file", str(garbage))):
        cfg = RedisTierConfig(url="rediss://127.0.0.1:1", **{key: value})
        with pytest.raises(TierConfigError, match=key):
            open_tier(cfg, NS)
    cfg = RedisTierConfig(url="rediss://127.0.0.1:1", tls_cert_file=missing)
    with pytest.raises(TierConfigError, match="tls_cert_file"):
        open_tier(cfg, NS)


@pytest.mark.parametrize("namespace", ["x" * 32, None, b"x", bytearray(32)])
def test_a_bad_namespace_is_a_typed_error(tmp_path, namespace):
    with pytest.raises(KVOffloadTypeError, match="namespace"):
        DiskTier(DiskTierConfig(**disk_kw(tmp_path)), namespace)
    with pytest.raises(KVOffloadTypeError, match="namespace"):
        RedisTier(RedisTierConfig(url="redis://127.0.0.1:1"), namespace)
    assert not os.path.exists(tmp_path / "tier" / "0001020304050607")


@pytest.fixture
def disk(tmp_path):
    t = DiskTier(DiskTierConfig(**disk_kw(tmp_path, read_threads=1, write_threads=1)), NS)
    yield t
    t.close()


@pytest.mark.parametrize("bad", [None, 5, 1.5, object(), [None], [(b"k", None, 1)]])
def test_garbage_at_the_tier_methods_is_an_error_of_the_root(disk, bad):
    # Before: raw TypeError ("'NoneType' object is not iterable") for several of them.
    calls = [
        lambda: disk.contains(bad),
        lambda: disk.submit_store(bad),
        lambda: disk.submit_load(bad),
        lambda: disk.lookup_async(bad).result(5),
    ]
    for call in calls:
        with pytest.raises(KVOffloadError):
            call()
    assert disk.contains([b"k"]) == [False]  # still working


def test_redis_refuses_keys_that_collide_in_its_key_format():
    # `<prefix>:<ns>:<hash hex>:<group>` reads the group from the last 4 bytes: b"\x01"
    # and b"\x00\x01" both became `jkv:<ns>::1`, so loading one found the other's entry,
    # called it corrupt and deleted it. Offload keys are a block hash + a 4-byte group.
    t = RedisTier(RedisTierConfig(url="redis://127.0.0.1:1"), NS)
    try:
        for short in (b"\x01", b"\x00\x01", b"abc"):
            with pytest.raises(TierKeyError, match="4"):
                t.submit_load([(short, bytearray(4))])
            with pytest.raises(TierKeyError, match="4"):
                t.contains([short])
        assert t.key_of(b"\x00\x00\x00\x01") != t.key_of(b"\x00\x00\x00\x00\x01")
    finally:
        t.close()


def test_a_directory_that_cannot_be_made_is_a_state_error(tmp_path):
    # Before: raw FileExistsError / FileNotFoundError / PermissionError from makedirs.
    (tmp_path / "file").write_text("")
    for path in (tmp_path / "file" / "tier", "/proc/jkv-tier", "/proc/1/jkv/tier"):
        with pytest.raises(TierStateError, match="tier directory"):
            DiskTier(DiskTierConfig(path=str(path), capacity_bytes=1 << 20), NS)


@pytest.mark.parametrize("bad", [None, 5, {}, "cfg"])
def test_namespace_of_something_that_is_not_a_config(bad):
    # Before: AttributeError ("'NoneType' object has no attribute 'parallel'").
    from jax_kvoffload.tiers import namespace_digest

    with pytest.raises(KVOffloadTypeError, match="OffloadingConfig"):
        namespace_digest(bad)


@pytest.mark.parametrize(
    ("kw", "family"),
    [
        ({"codec": "zstd"}, ValueError),
        ({"codec": None}, ValueError),
        ({"rank": -1}, ValueError),
        ({"rank": True}, TypeError),
        ({"rank": 1.0}, TypeError),
    ],
)
def test_namespace_options_errors_are_of_the_root(kw, family):
    from jax_kvoffload.tiers import namespace_digest
    from tests.tiers._helpers import offloading_config

    with pytest.raises(KVOffloadError) as info:
        namespace_digest(offloading_config(), **kw)
    assert isinstance(info.value, family)


@pytest.mark.parametrize(
    ("data", "value"),
    [(None, 0), ("abc", 0), ([1, 2], 0), (np.zeros((4, 4))[:, :2], 0), (b"x", "0"), (b"x", -1)],
)
def test_crc32c_of_garbage_is_an_error_of_the_root(data, value):
    # Before: raw TypeError/ValueError/OverflowError from memoryview or the C library.
    from jax_kvoffload.tiers import crc32c

    with pytest.raises(KVOffloadError):
        crc32c(data, value)


@pytest.mark.parametrize(
    "host", ["a" * 64 + ".example", "a..b", "é" * 70 + ".com", ".lead", "x" * 254]
)
def test_a_host_name_no_resolver_can_take_is_a_config_error(host):
    # Before: accepted, then every contains() raised a raw UnicodeError ("encoding with
    # 'idna' codec failed") into the engine, and every I/O task failed with it.
    with pytest.raises(TierConfigError, match="host name") as info:
        RedisTierConfig(url=f"redis://{host}:6379/0")
    assert info.value.key == "url"
    with pytest.raises(TierConfigError, match="host name"):
        RedisTierConfig(url="rediss://127.0.0.1:6379/0", tls_server_name=host)


@pytest.mark.parametrize("host", ["localhost", "bücher.example", "xn--zz.example", "[::1]",
                                  "10.0.0.1", "a" * 63 + ".example"])  # fmt: skip
def test_host_names_a_resolver_takes_are_accepted(host):
    assert RedisTierConfig(url=f"redis://{host}:6379/0").endpoint["port"] == 6379


def test_a_host_the_resolver_refuses_to_encode_is_a_failed_connect_not_an_exception():
    from jax_kvoffload.tiers._resp import Endpoint, RespConnection, RespConnectionError

    conn = RespConnection(Endpoint("a..b", 6379, None, 0, None, None, None, None, 0.5, 0.5))
    with pytest.raises(RespConnectionError, match="cannot connect"):
        conn.connect()
