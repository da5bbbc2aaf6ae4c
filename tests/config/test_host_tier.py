"""`host_tier_config`: the host tier's extra-config keys, parsed once, read as vLLM
0.33.0's specs read them (`int(...)`, `float(...)`), errors that name the key."""

from __future__ import annotations

import pytest

from jax_kvoffload.config import (
    ConfigFieldError,
    ConfigTypeError,
    DiskTierConfig,
    HostTierConfig,
    TierConfigError,
    host_tier_config,
)

# What vLLM's CPUOffloadingSpec does with these values: int(value) (a builtin error of
# the same family where it raises).
INTEGERS = [0, 1, 2, 7, "3", " 4 ", "-1", 2.7, -3, "x", "", None, [1], {}, True, 10**30]


def vllm_int(value):
    try:
        return int(value)
    except TypeError:
        return TypeError
    except ValueError:
        return ValueError


@pytest.mark.parametrize("key", ["store_threshold", "max_tracker_size"])
@pytest.mark.parametrize("value", INTEGERS, ids=repr)
def test_integer_keys_read_as_vllms_int(key, value):
    want = vllm_int(value)
    if isinstance(want, type):
        with pytest.raises(want, match=key):
            host_tier_config({key: value})
        family = ConfigTypeError if want is TypeError else ConfigFieldError
        with pytest.raises(family):
            host_tier_config({key: value})
    else:
        assert getattr(host_tier_config({key: value}), key) == want


def test_defaults_are_vllms():
    h = host_tier_config({})
    assert (h.cpu_bytes_to_use, h.eviction_policy, h.cache_policy_module_path) == (
        None,
        "lru",
        None,
    )
    assert (h.store_threshold, h.max_tracker_size, h.secondary_tiers) == (0, 64_000, ())
    assert (h.tier_poll_interval_s, h.host_pool, h.backpressure) == (0.001, "auto", None)
    assert HostTierConfig() == h


def test_store_kwargs_spell_vllms_off_values_as_the_store_does():
    h = host_tier_config({"store_threshold": 1, "max_tracker_size": -5})
    assert h.store_kwargs()["store_threshold"] == 0  # vLLM: below 2 is off
    assert h.store_kwargs()["max_tracker_size"] == 0  # vLLM: a negative size tracks nothing
    assert host_tier_config({"store_threshold": "2"}).store_kwargs()["store_threshold"] == 2


@pytest.mark.parametrize(
    ("value", "error"),
    [(True, ConfigTypeError), (1.5, ConfigTypeError), ([4096], ConfigTypeError),
     ("4KiB", ConfigFieldError), ("abc", ConfigFieldError)],
)  # fmt: skip
def test_the_byte_budget_is_never_truncated(value, error):
    with pytest.raises(error, match="cpu_bytes_to_use"):
        host_tier_config({"cpu_bytes_to_use": value})
    assert host_tier_config({"cpu_bytes_to_use": "8192"}).cpu_bytes_to_use == 8192


def test_keyword_arguments_win_over_keys():
    h = host_tier_config(
        {"cpu_bytes_to_use": 1, "eviction_policy": "arc", "host_pool": "numpy"},
        cpu_bytes_to_use=4096,
        eviction_policy="lru",
        host_pool="pinned",
    )
    assert (h.cpu_bytes_to_use, h.eviction_policy, h.host_pool) == (4096, "lru", "pinned")


def test_tiers_backpressure_and_poll_interval(tmp_path):
    h = host_tier_config(
        {
            "secondary_tiers": [{"type": "disk", "path": str(tmp_path), "capacity_bytes": "1GiB"}],
            "backpressure": {"backpressure_cls": "X"},
            "tier_poll_interval_s": "0",
        }
    )
    assert isinstance(h.secondary_tiers[0], DiskTierConfig)
    assert dict(h.backpressure) == {"backpressure_cls": "X"} and h.tier_poll_interval_s == 0.0
    with pytest.raises(TierConfigError, match="secondary_tiers"):
        host_tier_config({"secondary_tiers": {"type": "disk"}})
    with pytest.raises(ConfigFieldError, match="tier_poll_interval_s"):
        host_tier_config({"tier_poll_interval_s": "soon"})
    with pytest.raises(ConfigTypeError, match="backpressure"):
        host_tier_config({"backpressure": ["ema"]})
    with pytest.raises(ConfigFieldError, match="use one of"):
        host_tier_config({"host_pool": "gpu"})
    with pytest.raises(ConfigTypeError, match="extra_config"):
        host_tier_config(["cpu_bytes_to_use"])
