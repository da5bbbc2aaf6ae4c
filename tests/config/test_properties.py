"""Property tests over random engine and KV cache descriptions."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings

from jax_kvoffload.config import (
    OffloadConfigError,
    OffloadingConfig,
    build_offloading_config,
)

from .strategies import scenarios

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(scenario=scenarios())
def test_translation_raises_only_typed_errors_and_keeps_its_invariants(scenario):
    engine, kv = scenario
    try:
        cfg = build_offloading_config(engine, kv)
    except OffloadConfigError:
        return
    groups = kv.kv_cache_groups
    ids = [g.group_id for g in cfg.groups]
    assert ids == sorted(set(ids))
    assert all(0 <= i < len(groups) for i in ids)
    for g in cfg.groups:
        assert g.tokens_per_block % cfg.cache.tokens_per_hash == 0
        assert g.layer_names == groups[g.group_id].layer_names
    assert cfg.cache.blocks_per_chunk >= 0
    if cfg.replicated_layout and cfg.canonical_layout:
        assert cfg.parallel.is_parallelism_agnostic
    back = OffloadingConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg
    assert hash(back) == hash(cfg)
