"""The boundary dataclasses: frozen, hashable, JSON round trip, strict from_dict."""

from __future__ import annotations

import dataclasses
import json

import jax
import pytest

from jax_kvoffload.config import ConfigFieldError, FrozenDict, OffloadingConfig

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
    assert cfg.extra_config["secondary_tiers"] == ({"medium": "disk", "path": "/tmp/x"},)


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
