"""Offload keys: vLLM's byte layout, stable, validated."""

from __future__ import annotations

import pytest

from jax_kvoffload.store import get_offload_block_hash, get_offload_group_idx, make_offload_key


def test_layout_is_hash_plus_big_endian_group():
    key = make_offload_key(b"\xab\xcd", 258)
    assert key == b"\xab\xcd\x00\x00\x01\x02"
    assert get_offload_block_hash(key) == b"\xab\xcd"
    assert get_offload_group_idx(key) == 258


def test_round_trip_for_long_hash_and_max_group():
    block_hash = bytes(range(32))
    key = make_offload_key(block_hash, 2**32 - 1)
    assert len(key) == 36
    assert get_offload_block_hash(key) == block_hash
    assert get_offload_group_idx(key) == 2**32 - 1


def test_key_is_deterministic_bytes():
    assert make_offload_key(b"h", 1) == make_offload_key(b"h", 1)
    assert type(make_offload_key(b"h", 1)) is bytes


@pytest.mark.parametrize("bad", ["abc", bytearray(b"abc"), 3, None])
def test_block_hash_must_be_bytes(bad):
    with pytest.raises(TypeError, match="block_hash must be bytes"):
        make_offload_key(bad, 0)


@pytest.mark.parametrize("bad", [1.0, "0", True])
def test_group_idx_must_be_int(bad):
    with pytest.raises(TypeError, match="group_idx must be an int"):
        make_offload_key(b"h", bad)


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_group_idx_range(bad):
    with pytest.raises(ValueError, match=r"group_idx=.* must be in \[0, 2\*\*32\)"):
        make_offload_key(b"h", bad)


def test_short_key_is_rejected():
    with pytest.raises(ValueError, match="has 2 bytes"):
        get_offload_group_idx(b"ab")
