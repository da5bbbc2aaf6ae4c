"""offloading_config_from_vllm with stand-in objects shaped like vLLM 0.33.0's.

The stand-ins expose only the attributes vLLM's build_offloading_config reads, so these
tests prove the adapter needs nothing else (real vLLM: test_vllm_real.py).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import types

import pytest

from jax_kvoffload.bridge.vllm import convert_spec, offloading_config_from_vllm
from jax_kvoffload.config import (
    HiddenStateCacheSpec,
    MissingTransferConfigError,
    build_offloading_config,
)
from jax_kvoffload.errors import KVOffloadError, KVOffloadTypeError

from ..config import harness


class TorchDtype:
    """Prints like a torch dtype."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FullAttentionSpec:  # named like vLLM's: the adapter maps by class name
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: TorchDtype
    dcp_sharded: bool = True
    kv_quant_mode: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    num_kv_heads: int = 1
    head_size_v: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndexerCacheSpec(MLAAttentionSpec):
    """A vLLM MLA subclass this library has never heard of."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class UniformTypeKVCacheSpecs:
    block_size: int
    kv_cache_specs: dict


class Role:
    value = "default"


def ns(**kw):
    return types.SimpleNamespace(**kw)


def vllm_like(spec, *, tp=1, extra=None, engine_id="e0", backend="uni", total=4):
    model = ns(
        model="m",
        dtype=TorchDtype("bfloat16"),
        use_mla=False,
        max_model_len=2048,
        get_total_num_kv_heads=lambda: total,
    )
    parallel = ns(
        tensor_parallel_size=tp,
        pipeline_parallel_size=1,
        prefill_context_parallel_size=1,
        decode_context_parallel_size=1,
        data_parallel_size=1,
        data_parallel_index=0,
        data_parallel_rank_local=None,
        rank=0,
        world_size=tp,
        distributed_executor_backend=backend,
        nnodes_within_dp=1,
    )
    cache = ns(
        block_size=16,
        cache_dtype="auto",
        enable_prefix_caching=True,
        prefix_match_unit=None,
        kv_cache_layout=None,
    )
    transfer = ns(kv_connector_extra_config=extra or {}, engine_id=engine_id)
    vcfg = ns(
        model_config=model,
        cache_config=cache,
        parallel_config=parallel,
        kv_transfer_config=transfer,
        kv_events_config=None,
        use_v2_model_runner=False,
    )
    group = ns(layer_names=["l0", "l1"], kv_cache_spec=spec, role=Role())
    kv = ns(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[group], hisparse_host_num_blocks=None
    )
    return vcfg, kv


def test_stand_ins_give_the_same_config_as_our_own_objects():
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=64, dtype=TorchDtype("float16")
    )
    cfg = offloading_config_from_vllm(*vllm_like(spec, extra={"blocks_per_chunk": 4}))
    ours = build_offloading_config(
        harness.engine({"blocks_per_chunk": 4}, model_dtype="bfloat16", cache_dtype="auto"),
        harness.kv_config(harness.group(harness.full(16, 4, 64), "l0", "l1"), num_blocks=8),
    )
    assert cfg.groups == ours.groups
    assert cfg.cache == ours.cache
    assert cfg.worker_kv_bytes_per_block == ours.worker_kv_bytes_per_block == 2 * 4 * 16 * 128 * 2
    assert cfg.model.dtype == "bfloat16"
    assert cfg.model.max_model_len == 2048
    assert cfg.parallel.is_parallelism_agnostic is True


def test_spec_classes_map_by_name_and_unknown_mla_subclasses_stay_subclasses():
    mla = MLAAttentionSpec(block_size=16, head_size=576, dtype=TorchDtype("bfloat16"))
    assert type(convert_spec(mla)).__name__ == "MLAAttentionSpec"
    indexer = IndexerCacheSpec(block_size=16, head_size=128, dtype=TorchDtype("bfloat16"))
    assert type(convert_spec(indexer)) is HiddenStateCacheSpec
    # vLLM certifies exactly MLAAttentionSpec, so the subclass is not portable.
    canonical = offloading_config_from_vllm(*vllm_like(indexer, extra={"canonical_layout": 1}))
    assert canonical.parallel.is_parallelism_agnostic is False
    plain = offloading_config_from_vllm(*vllm_like(mla, extra={"canonical_layout": 1}))
    assert plain.parallel.is_parallelism_agnostic is True


def test_uniform_wrapper_converts_inner_specs():
    inner = {
        "l0": MLAAttentionSpec(block_size=16, head_size=576, dtype=TorchDtype("bfloat16")),
        "l1": MLAAttentionSpec(block_size=16, head_size=128, dtype=TorchDtype("bfloat16")),
    }
    cfg = offloading_config_from_vllm(
        *vllm_like(UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs=inner))
    )
    assert cfg.worker_kv_bytes_per_block == 16 * (576 + 128) * 2


def test_unknown_spec_classes_are_refused():
    class StrangeSpec:
        block_size = 16

    with pytest.raises(KVOffloadTypeError, match="unsupported KV cache spec StrangeSpec"):
        offloading_config_from_vllm(*vllm_like(StrangeSpec()))


def test_missing_engine_id_is_a_typed_error():
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=64, dtype=TorchDtype("float16")
    )
    with pytest.raises(MissingTransferConfigError, match="engine_id"):
        offloading_config_from_vllm(*vllm_like(spec, engine_id=None))


def test_executor_classes_are_never_mp():
    class MyExecutor:
        pass

    mla = MLAAttentionSpec(block_size=16, head_size=576, dtype=TorchDtype("bfloat16"))
    vcfg, kv = vllm_like(mla, tp=2, extra={"canonical_layout": True}, backend=MyExecutor)
    cfg = offloading_config_from_vllm(vcfg, kv)
    assert cfg.parallel.is_parallelism_agnostic is True
    assert cfg.replicated_layout is False  # world 2 needs the "mp" backend


class Exploding:
    """A property vLLM's function does not read on the path under test."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __get__(self, obj, owner=None):
        raise ValueError(f"{self.what} was read")


def lazy_vllm_like(spec, *, parallel=None, model=None, cache_dtype="fp8", **kw):
    vcfg, kv = vllm_like(spec, **kw)
    if parallel is not None:
        vcfg.parallel_config = parallel
    if model is not None:
        vcfg.model_config = model
    vcfg.cache_config.cache_dtype = cache_dtype
    return vcfg, kv


def parallel_ns(**kw):
    base = dict(
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        prefill_context_parallel_size=1,
        decode_context_parallel_size=1,
        data_parallel_size=1,
        data_parallel_index=0,
        data_parallel_rank_local=None,
        rank=0,
        world_size=1,
        distributed_executor_backend="uni",
    )
    base.update(kw)
    cls = type("Parallel", (), {"nnodes_within_dp": Exploding("nnodes_within_dp")})
    obj = cls()
    obj.__dict__.update(base)
    return obj


def model_ns(total=4, use_mla=False):
    cls = type(
        "Model",
        (),
        {
            "dtype": Exploding("model_config.dtype"),
            "get_total_num_kv_heads": lambda self: total,
        },
    )
    obj = cls()
    obj.__dict__.update(model="m", use_mla=use_mla, max_model_len=2048)
    return obj


def test_properties_vllm_does_not_read_are_not_read():
    # nnodes_within_dp raises in vLLM for some DP layouts; vLLM reads it last in the
    # replicated chain, and model_config.dtype only when cache_dtype == "auto".
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=64, dtype=TorchDtype("bfloat16")
    )
    vcfg, kv = lazy_vllm_like(spec, parallel=parallel_ns(), model=model_ns())
    cfg = offloading_config_from_vllm(vcfg, kv)
    assert cfg.model.dtype == "fp8" and cfg.replicated_layout is False
    # On the path that does read them, their errors are vLLM's.
    vcfg.cache_config.cache_dtype = "auto"
    with pytest.raises(ValueError, match=r"model_config\.dtype was read"):
        offloading_config_from_vllm(vcfg, kv)
    mla = MLAAttentionSpec(block_size=16, head_size=576, dtype=TorchDtype("bfloat16"))
    vcfg, kv = lazy_vllm_like(
        mla,
        parallel=parallel_ns(
            tensor_parallel_size=2, world_size=2, distributed_executor_backend="mp"
        ),
        model=model_ns(use_mla=True),
    )
    kv.kv_tp_replicas = 2
    with pytest.raises(ValueError, match="nnodes_within_dp was read"):
        offloading_config_from_vllm(vcfg, kv)


def test_attention_free_models_report_zero_kv_heads():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class MambaSpec:
        block_size: int
        shapes: tuple
        dtypes: tuple
        mamba_cache_mode: str = "none"

    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(TorchDtype("float32"),))
    vcfg, kv = lazy_vllm_like(mamba, model=model_ns(total=0), cache_dtype="auto")
    vcfg.model_config = ns(
        model="mamba", dtype=TorchDtype("float32"), use_mla=False, max_model_len=0,
        get_total_num_kv_heads=lambda: 0,
    )  # fmt: skip
    cfg = offloading_config_from_vllm(vcfg, kv)
    assert cfg.groups[0].sliding_window_size_in_chunks == 1
    assert cfg.worker_kv_bytes_per_block == 2 * 4 * 8 * 4


@pytest.mark.parametrize(("tp", "pcp", "dcp"), [(1, 4, 4), (8, 4, 32), (2, 2, 4)])
def test_prefill_context_parallel_topologies_vllm_accepts(tp, pcp, dcp):
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=64, dtype=TorchDtype("float16")
    )
    parallel = parallel_ns(
        tensor_parallel_size=tp,
        prefill_context_parallel_size=pcp,
        decode_context_parallel_size=dcp,
        world_size=tp * pcp,
        distributed_executor_backend="mp",
    )
    vcfg, kv = lazy_vllm_like(spec, parallel=parallel, model=model_ns())
    vcfg.cache_config.block_size = 16
    cfg = offloading_config_from_vllm(vcfg, kv)
    assert (cfg.parallel.pcp_size, cfg.parallel.dcp_size) == (pcp, dcp)
    assert cfg.groups[0].tokens_per_block == 16 * dcp


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ([2], TypeError),
        ({"n": 2}, TypeError),
        ((2,), TypeError),
        ("x", ValueError),
        (float("nan"), ValueError),
        (float("inf"), OverflowError),
        (2.5, ValueError),
    ],
)
def test_extra_config_values_raise_in_ints_families(value, error):
    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=64, dtype=TorchDtype("float16")
    )
    vcfg, kv = vllm_like(spec, extra={"blocks_per_chunk": value})
    with pytest.raises(error) as raised:
        offloading_config_from_vllm(vcfg, kv)
    assert isinstance(raised.value, KVOffloadError)
    assert "kv_connector_extra_config['blocks_per_chunk']" in str(raised.value)
    if error is TypeError:
        assert isinstance(raised.value, KVOffloadTypeError)
        assert not isinstance(raised.value, ValueError)


def test_importing_the_library_imports_neither_torch_nor_vllm():
    code = (
        "import sys, jax_kvoffload, pallas_kernels, jax_kvoffload.config, "
        "jax_kvoffload.bridge.vllm; "
        "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_kv_cache_layout_is_copied_as_vllm_copies_it_unchecked():
    """vLLM's own scheduler/config tests leave `kv_cache_layout` a test double: vLLM
    copies it without looking, and so does the adapter (our own constructors check)."""
    from jax_kvoffload.config import CacheConfig, ConfigTypeError

    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=4, head_size=64, dtype=TorchDtype("bfloat16")
    )
    for layout in (object(), "NHD", None):
        vcfg, kv = vllm_like(spec)
        vcfg.cache_config.kv_cache_layout = layout
        assert offloading_config_from_vllm(vcfg, kv).kv_cache_layout is layout
    with pytest.raises(ConfigTypeError, match="kv_cache_layout"):
        CacheConfig(block_size=16, kv_cache_layout=object())
