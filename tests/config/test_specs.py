"""Spec classes: page-size formulas (numbers checked on vLLM 0.33.0), quant modes, validation."""

from __future__ import annotations

import json
from fractions import Fraction

import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvoffload.config import (
    CacheConfig,
    CircularBufferSpec,
    ConfigFieldError,
    ConfigTypeError,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVEventsConfig,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    ModelConfig,
    ParallelConfig,
    SlidingWindowMLASpec,
    UniformTypeKVCacheSpecs,
)
from jax_kvoffload.config.internals import as_dtype, kv_quant_mode_for

from .harness import full, group, kv_config, ring


def test_verified_page_sizes():
    assert full(16, 8, 128, "bfloat16").page_size_bytes == 65536
    assert full(16, 8, 128, "bfloat16", head_size_v=64).page_size_bytes == 49152
    assert MLAAttentionSpec(block_size=64, head_size=576, dtype="bfloat16").page_size_bytes == 73728
    fp8_mla = MLAAttentionSpec(block_size=64, head_size=576, dtype="uint8", state_content_bytes=656)
    assert fp8_mla.page_size_bytes == 41984
    padded = MLAAttentionSpec(
        block_size=64, head_size=576, dtype="uint8", state_content_bytes=656, alignment=576
    )
    assert (padded.page_size_bytes, padded.real_page_size_bytes) == (42048, 41984)
    compressed = MLAAttentionSpec(
        block_size=64, head_size=512, dtype="bfloat16", tokens_per_state=4
    )
    assert compressed.page_size_bytes == 16384
    half_state = full(16, 2, 64, "float16", tokens_per_state=Fraction(1, 2))
    assert (half_state.num_states, half_state.page_size_bytes) == (32, 16384)
    ssm = MambaSpec(block_size=16, shapes=((4, 8), (3,)), dtypes=("float32", "bfloat16"))
    assert ssm.page_size_bytes == 134


def test_padding_and_slots():
    assert full(16, 8, 128, "bfloat16", page_size_padded=70000).page_size_bytes == 70000
    assert full(16, 8, 128, "bfloat16", num_head_slots=16).page_size_bytes == 131072
    with pytest.raises(ConfigFieldError, match="page_size_padded: 10 is smaller"):
        full(16, 8, 128, "bfloat16", page_size_padded=10)


def test_uniform_wrapper_sums_pages_and_copies_dcp_sharding():
    ssm = MambaSpec(block_size=16, shapes=((4,),), dtypes=("float32",))
    wrapper = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": full(), "b": full()})
    assert wrapper.page_size_bytes == 2 * full().page_size_bytes
    assert wrapper.dcp_sharded is True
    assert UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"s": ssm}).dcp_sharded is False
    assert not hasattr(wrapper, "real_page_size_bytes")
    with_ring = UniformTypeKVCacheSpecs(block_size=4, kv_cache_specs={"r": ring(4)})
    assert with_ring.prefix_cacheable is False


def test_prefix_cacheability_and_group_ids():
    bounded = SlidingWindowMLASpec(
        block_size=16, head_size=576, dtype="bfloat16", sliding_window=64, bounded_replay=True
    )
    assert bounded.prefix_cacheable is False
    kv = kv_config(
        group(full(), "a"),
        group(ring(), "b"),
        group(full(), "c", enable_kv_transfer=False),
        group(bounded, "d"),
    )
    assert kv.transfer_group_ids == (0, 1, 3)
    assert kv.prefix_cacheable_group_ids == (0,)


def test_quant_modes():
    assert KVQuantMode.CUSTOM is KVQuantMode.OCTAVE_K3V4
    assert KVQuantMode.CUSTOM.name == "OCTAVE_K3V4"
    per_token = {m for m in KVQuantMode if m.is_per_token_head}
    assert per_token == {
        KVQuantMode.INT8_PER_TOKEN_HEAD,
        KVQuantMode.FP8_PER_TOKEN_HEAD,
        KVQuantMode.INT4_PER_TOKEN_HEAD,
    }
    assert kv_quant_mode_for("nvfp4_ds_mla") is KVQuantMode.NVFP4_DS_MLA
    assert kv_quant_mode_for("nvfp4_4over6") is KVQuantMode.NVFP4
    assert kv_quant_mode_for("turboquant_k8v4") is KVQuantMode.TURBOQUANT_K8V4
    assert kv_quant_mode_for("fp8_e5m2") is KVQuantMode.FP8_PER_TENSOR
    assert kv_quant_mode_for("int8_per_token_head") is KVQuantMode.INT8_PER_TOKEN_HEAD
    assert kv_quant_mode_for("bfloat16") is KVQuantMode.NONE


def test_dtypes_accept_jax_numpy_and_names():
    assert full(dtype=jnp.bfloat16).dtype == as_dtype("bfloat16")
    assert full(dtype="torch.float8_e4m3fn").dtype.itemsize == 1
    assert as_dtype("fp8_e5m2") == jnp.dtype(jnp.float8_e5m2)
    with pytest.raises(ConfigFieldError, match=r"dtype: unknown dtype name 'float13'; use"):
        full(dtype="float13")
    assert CacheConfig(cache_dtype=jnp.float16).cache_dtype == "float16"
    assert CacheConfig(cache_dtype="fp8_ds_mla").cache_dtype == "fp8_ds_mla"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: full(bs=0), "block_size: must be >= 1, got 0"),
        (lambda: full(heads=0), "num_kv_heads: must be >= 1, got 0"),
        (
            lambda: KVCacheConfig(num_blocks=-1, kv_cache_tensors=(), kv_cache_groups=()),
            "num_blocks: must be >= 0, got -1",
        ),
        (lambda: ParallelConfig(tensor_parallel_size=0), "tensor_parallel_size: must be >= 1"),
        (lambda: ParallelConfig(tensor_parallel_size=2, rank=2), r"rank: 2 is not in \[0, "),
        (
            lambda: ParallelConfig(decode_context_parallel_size=2),
            r"tensor_parallel_size=1 must be divisible by decode_context_parallel_size=2 "
            r"\(vLLM's rule\); use one of \[1\]",
        ),
        (
            lambda: ParallelConfig(
                tensor_parallel_size=2,
                prefill_context_parallel_size=2,
                decode_context_parallel_size=2 * 3,
            ),
            r"use one of \[1, 2, 4\]",
        ),
        (
            lambda: ParallelConfig(distributed_executor_backend="slurm"),
            "distributed_executor_backend: got 'slurm'; use one of",
        ),
        (
            lambda: MambaSpec(block_size=16, shapes=((1,),), dtypes=()),
            "dtypes: has 0 entries but shapes has 1",
        ),
    ],
)
def test_constructors_reject_bad_values_naming_the_field(make, message):
    with pytest.raises(ConfigFieldError, match=message):
        make()


def test_constructors_reject_wrong_types():
    with pytest.raises(ConfigTypeError, match=r"block_size: must be an int, got float 16\.0"):
        full(bs=16.0)
    with pytest.raises(ConfigTypeError, match="layer_names: must be a list or tuple of str"):
        KVCacheGroupSpec(layer_names="l0", kv_cache_spec=full())
    with pytest.raises(ConfigTypeError, match="kv_cache_spec: must be a KVCacheSpec"):
        KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec="full")


def test_parallel_defaults_follow_vllm():
    single = ParallelConfig()
    assert (single.world_size, single.distributed_executor_backend) == (1, "uni")
    multi = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert (multi.world_size, multi.distributed_executor_backend) == (4, "mp")
    # vLLM counts processes across DP for the default backend, and multiplies the world
    # by DP for the external launcher.
    assert ParallelConfig(data_parallel_size=2).distributed_executor_backend == "mp"
    launcher = ParallelConfig(
        tensor_parallel_size=2,
        data_parallel_size=2,
        distributed_executor_backend="external_launcher",
    )
    assert launcher.world_size == 4


@pytest.mark.parametrize(
    ("tp", "pcp", "dcp"),
    [(1, 4, 4), (8, 4, 32), (2, 2, 2), (2, 2, 4), (2, 2, 1), (4, 1, 2), (6, 1, 3)],
)
def test_parallel_accepts_every_dcp_vllm_accepts(tp, pcp, dcp):
    # vLLM 0.33.0 requires tp % dcp == 0 only without PCP; with PCP, dcp in {1, pcp, tp*pcp}.
    p = ParallelConfig(
        tensor_parallel_size=tp,
        prefill_context_parallel_size=pcp,
        decode_context_parallel_size=dcp,
    )
    assert p.world_size == tp * pcp


def test_numpy_integers_are_ints_and_stored_as_python_ints():
    spec = full(bs=np.int64(16), heads=np.int32(4))
    assert spec == full(bs=16, heads=4) and type(spec.block_size) is int
    p = ParallelConfig(tensor_parallel_size=np.int64(2), rank=np.uint8(1))
    assert (p.tensor_parallel_size, p.rank, p.world_size) == (2, 1, 2)
    assert type(p.world_size) is int
    kv = KVCacheConfig(num_blocks=np.int64(8), kv_cache_tensors=(), kv_cache_groups=())
    assert json.dumps(kv.num_blocks) == "8"
    with pytest.raises(ConfigTypeError, match="block_size: must be an int, got bool"):
        full(bs=np.bool_(True))


@pytest.mark.parametrize("dtype", ["object", np.complex64, "complex128", "bool", np.bool_, "U8"])
def test_dtypes_that_hold_no_kv_cache_are_refused(dtype):
    with pytest.raises(ConfigFieldError, match="is not a KV cache element type; use a float"):
        full(dtype=dtype)
    with pytest.raises(ConfigFieldError, match="dtype: "):
        ModelConfig(model="m", dtype=dtype, total_num_kv_heads=1)


def test_attention_free_models_may_report_zero_kv_heads():
    assert ModelConfig(model="mamba", dtype="float32", total_num_kv_heads=0).total_num_kv_heads == 0


def test_kv_cache_layout_is_copied_through():
    # vLLM copies cache_config.kv_cache_layout as it is; so do we (members by name).
    assert CacheConfig(kv_cache_layout="HND").kv_cache_layout == "HND"
    assert CacheConfig(kv_cache_layout="anything").kv_cache_layout == "anything"
    assert CacheConfig(kv_cache_layout=KVCacheLayout.LBHNC).kv_cache_layout == "LBHNC"
    with pytest.raises(ConfigTypeError, match="kv_cache_layout: must be a str"):
        CacheConfig(kv_cache_layout=3)


@pytest.mark.parametrize(
    "make",
    [
        lambda: KVCacheGroupSpec(layer_names={"a", "b"}, kv_cache_spec=full()),
        lambda: FullAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=[1]
        ),
        lambda: MLAAttentionSpec(block_size=16, head_size=8, dtype="float16", cache_role=["x"]),
        lambda: MambaSpec(block_size=16, shapes=((1,),), dtypes=("float32",), mamba_type={}),
        lambda: KVCacheConfig(num_blocks=1, kv_cache_tensors={}, kv_cache_groups=()),
        lambda: KVEventsConfig(enable_kv_cache_events="yes"),
    ],
)
def test_unhashable_or_unordered_values_are_refused_with_a_type_error(make):
    # A set of layer names has no order; a list in a scalar field would make the config
    # unhashable (and so unusable as a jit static) much later.
    with pytest.raises(ConfigTypeError):
        make()


def test_specs_are_hashable_and_draft_flag_is_not_compared():
    assert hash(full()) == hash(full())
    assert (
        FullAttentionSpec(
            block_size=16, num_kv_heads=4, head_size=128, dtype="float16", is_draft=True
        )
        == full()
    )
    assert CircularBufferSpec(block_size=4, num_kv_heads=4, head_size=64, dtype="float16") == ring()
