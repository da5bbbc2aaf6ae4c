"""Our translation against vLLM 0.33.0's own, on identical vLLM objects.

Skipped unless vLLM is importable (see docs/vllm.md for the CPU-only install). Every case
runs vLLM's `build_offloading_config` and our `offloading_config_from_vllm` on the same
objects and compares the results field by field, or the error conditions.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
vllm = pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (  # noqa: E402
    build_offloading_config as vllm_build,
)

from jax_kvoffload.bridge.vllm import offloading_config_from_vllm  # noqa: E402
from jax_kvoffload.config import OffloadConfigError  # noqa: E402

from ..config import harness  # noqa: E402
from ..config.strategies import scenarios  # noqa: E402
from . import vllm_objects  # noqa: E402

pytestmark = pytest.mark.vllm


def compare(engine, kv):
    """Runs both translations; asserts equal results or errors under the same condition."""
    vcfg = vllm_objects.vllm_config(engine)
    vkv = vllm_objects.kv_cache_config(kv)
    try:
        expected = vllm_build(vcfg, vkv)
    except (ValueError, AssertionError, ZeroDivisionError) as exc:
        with pytest.raises(OffloadConfigError) as ours:
            offloading_config_from_vllm(vcfg, vkv)
        # Same rule: vLLM's message text is kept wherever vLLM writes one (Python's own
        # int() parse and division errors are replaced by messages naming the key).
        if str(exc) and not isinstance(exc, ZeroDivisionError) and "literal" not in str(exc):
            assert str(exc).split(".")[0][:40] in str(ours.value), (str(exc), str(ours.value))
        return None
    if expected.cache.blocks_per_chunk < 0:  # a documented difference (docs/config.md)
        with pytest.raises(OffloadConfigError, match="'block_size' must be >= 0"):
            offloading_config_from_vllm(vcfg, vkv)
        return None
    actual = offloading_config_from_vllm(vcfg, vkv)
    assert vllm_objects.as_plain(actual) == vllm_objects.as_plain(expected)
    return actual


def test_vllm_is_the_pinned_version():
    assert vllm.__version__ == "0.33.0"


CASES = {
    "a1_tp3_pp2": (
        dict(extra={"block_size": 32}, tp=3, pp=2),
        dict(
            groups=[(harness.full(16, 1, 1, "float32"), ("l0", "l1"))], num_blocks=4, packed_page=8
        ),
    ),
    "a6_pcp": (dict(extra={"block_size": 64}, pcp=2), dict(groups=[(harness.full(), ("l0",))])),
    "a7_dcp_mamba": (
        dict(tp=2, dcp=2),
        dict(groups=[(harness.full(16), ("a",)), (harness.mamba(16, "align"), ("b",))]),
    ),
    "a10_hetero": (
        dict(block_size=4, extra={"blocks_per_chunk": 2}),
        dict(groups=[(harness.full(12), ("a",)), (harness.mla(16, 512), ("b",))]),
    ),
    "a10_hetero_block_size": (
        dict(block_size=4, extra={"block_size": 48}),
        dict(groups=[(harness.full(12), ("a",)), (harness.mla(16, 512), ("b",))]),
    ),
    "a13_not_multiple": (dict(extra={"block_size": 40}), dict(groups=[(harness.full(), ("a",))])),
    "a13_zero": (dict(extra={"block_size": 0}), dict(groups=[(harness.full(), ("a",))])),
    "a12_zero_bpc": (
        dict(extra={"blocks_per_chunk": "0"}),
        dict(groups=[(harness.full(), ("a",))]),
    ),
    "a14_rings": (dict(), dict(groups=[(harness.ring(4), ("a",)), (harness.ring(8), ("b",))])),
    "a16_mamba_none": (
        dict(),
        dict(groups=[(harness.full(16), ("a",)), (harness.mamba(24, "none"), ("b",))]),
    ),
    "ar1_mla_replicated": (
        dict(use_mla=True, tp=4),
        dict(
            groups=[(harness.mla(16, 512, "float32"), ("m0", "m1"))],
            num_blocks=4,
            packed_page=harness.mla(16, 512, "float32").page_size_bytes,
            kv_tp_replicas=4,
        ),
    ),
    "ar5_canonical_mla_uni": (
        dict(extra={"canonical_layout": True}, use_mla=True, distributed_executor_backend="uni"),
        dict(groups=[(harness.mla(), ("m",))]),
    ),
    "ap5_canonical_gqa": (
        dict(extra={"canonical_layout": "false"}, tp=4, total_kv_heads=2),
        dict(groups=[(harness.full(16, 1), ("a",))]),
    ),
    "b2_single_group_unit": (
        dict(tp=2, dcp=2, block_size=64, prefix_match_unit=16),
        dict(groups=[(harness.full(16), ("a",))]),
    ),
}


def build_case(engine_kw, kv_kw):
    extra = engine_kw.pop("extra", None)
    engine = harness.engine(extra, **engine_kw)
    groups = [harness.group(spec, *names) for spec, names in kv_kw["groups"]]
    tensors = ()
    if "packed_page" in kv_kw:
        names = tuple(n for g in groups for n in g.layer_names)
        tensors = (harness.packed_tensor(names, kv_kw["packed_page"], kv_kw["num_blocks"]),)
    kv = harness.kv_config(
        *groups,
        num_blocks=kv_kw.get("num_blocks", 0),
        tensors=tensors,
        kv_tp_replicas=kv_kw.get("kv_tp_replicas", 1),
    )
    return engine, kv


@pytest.mark.parametrize("name", sorted(CASES))
def test_named_cases_match_vllm(name):
    engine_kw, kv_kw = CASES[name]
    compare(*build_case(dict(engine_kw), kv_kw))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_random_configs_match_vllm(scenario):
    compare(*scenario)
