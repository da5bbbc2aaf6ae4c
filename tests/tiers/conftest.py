"""Fixtures of the tier tests: a private directory and a private Redis server."""

from __future__ import annotations

import pytest

from jax_kvoffload.tiers import DiskTier, DiskTierConfig, RedisTier, RedisTierConfig

from ._helpers import NO_REDIS, REDIS_SERVER, RedisServer

NS = bytes(range(32))


@pytest.fixture
def tier_path(tmp_path):
    return str(tmp_path / "tier")


@pytest.fixture
def disk(tier_path):
    tier = DiskTier(DiskTierConfig(path=tier_path, capacity_bytes=1 << 30), NS)
    yield tier
    tier.close()


@pytest.fixture(scope="module")
def redis_server():
    if REDIS_SERVER is None:
        pytest.skip(NO_REDIS)
    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture
def redis(redis_server):
    redis_server.call(b"FLUSHALL")
    tier = RedisTier(RedisTierConfig(url=redis_server.url, io_timeout_s=2.0), NS)
    yield tier
    tier.close()
