"""The boundary dataclasses: frozen, hashable, JSON round trip, strict from_dict."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from jax_kvoffload.config import (
    ConfigFieldError,
    ConfigTypeError,
    KVTransferConfig,
    OffloadingConfig,
)
from jax_kvoffload.config.internals import FrozenDict, thaw

from .harness import build, full, group, kv_config

EXTRA = {
    "spec_name": "CPUOffloadingSpec",
    "cpu_bytes_to_use": 8_000_000_000,
    "blocks_per_chunk": 2,
    "secondary_tiers": [{"medium": "disk", "path": "/tmp/x"}],
}


def sample() -> OffloadingConfig:
    kv = kv_config(group(full(), "l0", "l1"), num_blocks=8)
    return build(kv, EXTRA, tp=2, total_kv_heads=8)


def test_configs_are_frozen_and_hashable():
    cfg = sample()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.engine_id = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.extra_config["blocks_per_chunk"] = 3  # type: ignore[index]
    assert hash(cfg) == hash(sample())


def test_extra_config_reads_give_vllms_structures_and_never_change_the_config():
    # vLLM's tiering spec checks `isinstance(secondary_tiers, list)` and each tier
    # `isinstance(tier, dict)`: reads hand out fresh lists and dicts, as written.
    cfg = sample()
    before = hash(cfg)
    tiers = cfg.extra_config["secondary_tiers"]
    assert type(tiers) is list and type(tiers[0]) is dict
    assert tiers == [{"medium": "disk", "path": "/tmp/x"}]
    tiers[0]["path"] = "/elsewhere"
    tiers.append({"medium": "obj"})
    assert cfg.extra_config["secondary_tiers"] == [{"medium": "disk", "path": "/tmp/x"}]
    assert dict(cfg.extra_config)["secondary_tiers"] is not tiers
    assert hash(cfg) == before == hash(sample())
    # The caller's own dict is copied: changing it afterwards changes nothing either.
    extra = {"blocks_per_chunk": 2, "tiers": [1]}
    frozen = FrozenDict(extra)
    extra["tiers"].append(2)
    assert frozen["tiers"] == [1]


def test_extra_config_sets_normalise_and_unhashable_values_are_refused():
    with_set = FrozenDict({"s": {3, 1}, "t": (1, [2])})
    assert hash(with_set) == hash(FrozenDict({"s": {1, 3}, "t": (1, [2])}))
    assert with_set["s"] == {1, 3} and type(with_set["t"]) is tuple
    assert thaw(with_set) == {"s": [1, 3], "t": [1, [2]]}  # JSON-ready
    with pytest.raises(
        ConfigTypeError, match=r"extra_config\['b'\]: holds an unhashable bytearray"
    ):
        FrozenDict({"b": bytearray(b"x")})
    with pytest.raises(ConfigTypeError, match=r"kv_connector_extra_config\['b'\]"):
        KVTransferConfig(kv_connector_extra_config={"b": [np.zeros(2)]})
    nested: list = []
    nested.append(nested)
    with pytest.raises(ConfigFieldError, match="deeper than 64 levels"):
        FrozenDict({"loop": nested})
    with pytest.raises(ConfigTypeError, match="must be a mapping"):
        KVTransferConfig(kv_connector_extra_config=[("a", 1)])


def test_configs_work_as_jit_statics():
    cfg = sample()
    f = jax.jit(lambda x, c: x * c.cache.blocks_per_chunk, static_argnums=1)
    assert int(f(3, cfg)) == 6


def test_json_round_trip():
    cfg = sample()
    text = json.dumps(cfg.to_dict())
    back = OffloadingConfig.from_dict(json.loads(text))
    assert back == cfg
    assert back.to_dict() == cfg.to_dict()
    assert isinstance(back.extra_config, FrozenDict)
    assert back.groups[0].layer_names == ("l0", "l1")


def test_from_dict_names_unknown_and_missing_keys():
    data = sample().to_dict()
    data["typo"] = 1
    with pytest.raises(ConfigFieldError, match=r"OffloadingConfig: unknown keys \['typo'\]"):
        OffloadingConfig.from_dict(data)
    data = sample().to_dict()
    del data["cache"]["tokens_per_hash"]
    with pytest.raises(ConfigFieldError, match=r"cache: missing keys \['tokens_per_hash'\]"):
        OffloadingConfig.from_dict(data)


def test_frozen_dict_compares_with_plain_dicts():
    frozen = FrozenDict({"a": [1, {"b": 2}]})
    assert frozen == {"a": [1, {"b": 2}]}
    assert frozen == {"a": (1, {"b": 2})}
    assert frozen != {"a": [1]}
    assert len(frozen) == 1 and list(frozen) == ["a"]
