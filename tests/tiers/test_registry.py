"""The tier registry: each kind declared once, the parser, the factory, the assembly and
the vLLM classes derived from it, and a kind registered at run time joins all of them."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from typing import ClassVar

import pytest

from jax_kvoffload.assembly import open_tiers
from jax_kvoffload.config import ConfigFieldError, ConfigTypeError, host_tier_config
from jax_kvoffload.errors import KVOffloadTypeError
from jax_kvoffload.tiers import (
    DiskTier,
    DiskTierConfig,
    MooncakeTier,
    MooncakeTierConfig,
    RedisTier,
    RedisTierConfig,
    SecondaryTier,
    TierConfigError,
    TierJobResult,
    TierKind,
    TierOptions,
    open_tier,
    parse_secondary_tiers,
    register_tier_kind,
    tier_class,
    tier_kinds,
    unregister_tier_kind,
)

from ._helpers import offloading_config


@dataclasses.dataclass(frozen=True, kw_only=True)
class NullTierConfig(TierOptions):
    EXAMPLES: ClassVar = {"label": '"label": "x"'}
    label: str
    size: int = 1


class NullTier(SecondaryTier):
    """Holds nothing: every lookup and load misses, every store succeeds."""

    medium = "remote"

    def __init__(self, config, namespace, *, describe=None):
        super().__init__(namespace)
        self.config, self.describe = config, describe

    def contains(self, keys):
        return [False] * len(keys)

    def _done(self, kind, items, ok):
        future = cf.Future()
        keys = tuple(k for k, _ in items)
        future.set_result(TierJobResult(kind, keys, (ok,) * len(keys)))
        return future

    def submit_store(self, items):
        return self._done("store", items, True)

    def submit_load(self, items):
        return self._done("load", items, False)

    def drain(self, timeout=None):
        return True

    def _close_io(self):
        pass


NULL = TierKind("null", NullTierConfig, NullTier, "JaxNullTier")


@pytest.fixture
def null_kind():
    register_tier_kind(NULL)
    yield NULL
    unregister_tier_kind("null")


def test_the_built_in_kinds_and_what_follows_from_them():
    assert [(k.name, k.config, tier_class(k), k.vllm_class) for k in tier_kinds()] == [
        ("disk", DiskTierConfig, DiskTier, "JaxDiskTier"),
        ("redis", RedisTierConfig, RedisTier, "JaxRedisTier"),
        ("mooncake", MooncakeTierConfig, MooncakeTier, "JaxMooncakeTier"),
    ]
    assert DiskTierConfig(path="/d", capacity_bytes=1).type == "disk"
    assert RedisTierConfig(url="redis://h").to_vllm_dict()["type"] == "JaxRedisTier"


def test_a_kind_registered_at_run_time_is_parsed_opened_and_assembled(null_kind):
    (cfg,) = parse_secondary_tiers([{"type": "null", "label": "a", "size": 3}])
    assert cfg == NullTierConfig(label="a", size=3) and cfg.type == "null"
    assert cfg.to_vllm_dict() == {
        "type": "JaxNullTier",
        "module_path": "jax_kvoffload.bridge._vllm_tiers",
        "label": "a",
        "size": 3,
    }
    assert parse_secondary_tiers([cfg.to_vllm_dict()]) == (cfg,)
    tier = open_tier(cfg, bytes(32), describe={"model": "m"})
    assert type(tier) is NullTier and tier.describe == {"model": "m"}
    host = host_tier_config({"secondary_tiers": [{"type": "null", "label": "b"}]})
    (opened,) = open_tiers(offloading_config(), host)
    assert isinstance(opened, NullTier) and opened.config.label == "b"
    with pytest.raises(
        TierConfigError, match=r'secondary_tiers\[0\].label: is required, e.g. "label": "x"'
    ):
        parse_secondary_tiers([{"type": "null"}])
    with pytest.raises(TierConfigError, match=r"ours: \['disk', 'mooncake', 'null', 'redis'\]"):
        parse_secondary_tiers([{"type": "nothing"}])
    with pytest.raises(TierConfigError, match='use "disk", "redis", "mooncake" or "null" here'):
        open_tier(parse_secondary_tiers([{"type": "fs"}])[0], bytes(32))


def test_a_registered_kind_has_its_vllm_class(null_kind):
    pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed")
    from vllm.v1.kv_offload.base import Medium
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from jax_kvoffload.bridge import _vllm_tiers

    cls = _vllm_tiers.JaxNullTier
    assert cls is _vllm_tiers.JaxNullTier and cls.__name__ == "JaxNullTier"
    assert cls.__module__ == "jax_kvoffload.bridge._vllm_tiers"
    assert cls.medium is Medium.STORAGE  # a "remote" tier: an external hit source
    assert cls.cache_hit_source is CacheHitSource.EXTERNAL_UNSPECIFIED
    assert "JaxNullTier" in dir(_vllm_tiers)
    assert _vllm_tiers.JaxDiskTier.cache_hit_source is CacheHitSource.DISK


def test_after_unregistering_the_kind_is_unknown_again():
    register_tier_kind(NULL)
    assert unregister_tier_kind("null") is NULL
    with pytest.raises(TierConfigError, match="unknown tier type"):
        parse_secondary_tiers([{"type": "null", "label": "a"}])
    with pytest.raises(ConfigTypeError, match="no registered tier kind"):
        NullTierConfig(label="a").to_dict()
    with pytest.raises(
        KVOffloadTypeError,
        match=r"\(DiskTierConfig, RedisTierConfig, MooncakeTierConfig\), got Null",
    ):
        open_tier(NullTierConfig(label="a"), bytes(32))
    with pytest.raises(ConfigFieldError, match="no registered tier kind"):
        unregister_tier_kind("null")


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        (TierKind("other", NullTierConfig, NullTier, "JaxDiskTier"), "vllm_class"),
        (TierKind("disk", NullTierConfig, NullTier, "JaxOtherTier"), "name"),
        (TierKind("other", DiskTierConfig, NullTier, "JaxOtherTier"), "config"),
        (TierKind("fs", NullTierConfig, NullTier, "JaxFsTier"), "vLLM's own"),
    ],
)
def test_a_kind_that_clashes_is_refused(kind, words):
    with pytest.raises(ConfigFieldError, match=words):
        register_tier_kind(kind)
    assert [k.name for k in tier_kinds()] == ["disk", "redis", "mooncake"]


@pytest.mark.parametrize(
    ("fields", "error", "words"),
    [
        ({"name": "Disk2"}, ConfigFieldError, "lower-case identifier"),
        ({"config": dict}, ConfigTypeError, "subclassing TierOptions"),
        ({"tier": "no_colon"}, ConfigFieldError, "package.module:Class"),
        ({"tier": 3}, ConfigTypeError, "import path or a class"),
        ({"vllm_class": "Jax Null"}, ConfigFieldError, "class name"),
    ],
)
def test_a_malformed_kind_is_refused(fields, error, words):
    with pytest.raises(error, match=words):
        dataclasses.replace(NULL, **fields)


def test_a_kind_naming_no_tier_class_is_refused_when_opened():
    kind = TierKind("bad", NullTierConfig, "jax_kvoffload.tiers._errors:TierStateError", "JaxB")
    with pytest.raises(KVOffloadTypeError, match="must name a SecondaryTier subclass"):
        tier_class(kind)
