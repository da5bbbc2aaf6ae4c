"""resolve_kv_cache_block_sizes / resolve_dcp_kv_block_size (vLLM's
tests/v1/core/test_kv_cache_utils.py cases, re-expressed for 0.33.0)."""

from __future__ import annotations

import pytest

from jax_kvoffload.config import PrefixMatchUnitError, StateAlignmentError, UniformTypeKVCacheSpecs
from jax_kvoffload.config.internals import resolve_dcp_kv_block_size, resolve_kv_cache_block_sizes

from .harness import engine, full, group, kv_config, mamba, mla


def sizes(*groups, **engine_kw):
    return resolve_kv_cache_block_sizes(kv_config(*groups), engine(**engine_kw))


def test_b1_single_group_uses_the_cache_block_size_times_dcp():
    assert sizes(group(full(16)), tp=2, dcp=2) == (32, 32)
    assert sizes(group(mamba(16)), tp=2, dcp=2) == (16, 16)  # not DCP-sharded
    assert sizes(group(full(16)), tp=2, dcp=2, block_size=64) == (128, 128)  # cache wins
    assert sizes(tp=2, dcp=2, block_size=64) == (128, 128)  # zero groups keep dcp


def test_b2_single_group_prefix_match_unit_must_equal_the_block_size():
    with pytest.raises(PrefixMatchUnitError, match="Invalid prefix_match_unit=16") as err:
        sizes(group(full(16)), tp=2, dcp=2, block_size=64, prefix_match_unit=16)
    assert "128" in str(err.value)
    assert sizes(group(full(16)), tp=2, dcp=2, block_size=64, prefix_match_unit=128) == (128, 128)


def test_b3_multi_group_gcd_and_prefix_match_unit():
    two = (group(full(12), "a"), group(full(16), "b"))
    assert sizes(*two) == (48, 4)
    assert sizes(*two, prefix_match_unit=2) == (48, 2)
    with pytest.raises(PrefixMatchUnitError, match="must be divisible by prefix_match_unit"):
        sizes(*two, prefix_match_unit=8)
    assert sizes(*two, enable_prefix_caching=False, transfer=False) == (48, 48)


def test_b4_mamba_modes():
    assert sizes(group(full(16), "a"), group(mamba(24, "none"), "b")) == (48, 48)
    assert sizes(group(full(16), "a"), group(mamba(64, "align"), "b")) == (64, 16)


def test_b5_per_state_compression():
    assert sizes(group(full(16), "a"), group(mla(16, 512, tps=4), "b")) == (16, 16)
    assert sizes(group(full(8), "a"), group(mla(32, 512, tps=16), "b")) == (32, 8)


def test_partial_mamba_hits_must_align_with_state_compression():
    # A Mamba align group larger than the hash enables partial hits at the hash size,
    # which the 16-token compressed MLA states cannot land on.
    groups = (
        group(full(8), "a"),
        group(mla(32, 512, tps=16), "b"),
        group(mamba(32, "align"), "c"),
    )
    with pytest.raises(StateAlignmentError, match="per-state compression") as err:
        sizes(*groups)
    assert err.value.alignments == (16,)


def test_b6_resolve_dcp_kv_block_size():
    assert resolve_dcp_kv_block_size(full(16), 4) == 64
    assert resolve_dcp_kv_block_size(mamba(16), 4) == 16
    wrapper = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": mla(16), "b": mla(16)})
    assert resolve_dcp_kv_block_size(wrapper, 2) == 32
