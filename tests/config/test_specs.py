"""Spec classes: page-size formulas (numbers checked on vLLM 0.33.0), quant modes, validation."""

from __future__ import annotations

from fractions import Fraction

import jax.numpy as jnp
import pytest

from jax_kvoffload.config import (
    CacheConfig,
    CircularBufferSpec,
    ConfigFieldError,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    ParallelConfig,
    SlidingWindowMLASpec,
    UniformTypeKVCacheSpecs,
    as_dtype,
    kv_quant_mode_for,
)

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
    with pytest.raises(ConfigFieldError, match=r"dtype: unknown dtype name 'float13'"):
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
            "tensor_parallel_size=1 must be divisible by decode_context_parallel_size=2",
        ),
        (
            lambda: ParallelConfig(distributed_executor_backend="slurm"),
            "distributed_executor_backend: must be one of",
        ),
        (lambda: CacheConfig(kv_cache_layout="XYZ"), "kv_cache_layout: unknown layout 'XYZ'"),
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
    with pytest.raises(TypeError, match="block_size must be an int"):
        full(bs=16.0)
    with pytest.raises(TypeError, match="layer_names must be a sequence of str"):
        KVCacheGroupSpec(layer_names="l0", kv_cache_spec=full())
    with pytest.raises(TypeError, match="kv_cache_spec must be a KVCacheSpec"):
        KVCacheGroupSpec(layer_names=("l0",), kv_cache_spec="full")


def test_parallel_defaults_follow_vllm():
    single = ParallelConfig()
    assert (single.world_size, single.distributed_executor_backend) == (1, "uni")
    multi = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert (multi.world_size, multi.distributed_executor_backend) == (4, "mp")


def test_specs_are_hashable_and_draft_flag_is_not_compared():
    assert hash(full()) == hash(full())
    assert (
        FullAttentionSpec(
            block_size=16, num_kv_heads=4, head_size=128, dtype="float16", is_draft=True
        )
        == full()
    )
    assert CircularBufferSpec(block_size=4, num_kv_heads=4, head_size=64, dtype="float16") == ring()
