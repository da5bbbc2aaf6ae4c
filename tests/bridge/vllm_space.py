"""Random inputs drawn from vLLM 0.33.0's own config space (used only when vLLM imports).

Every object is built with vLLM's classes: `ParallelConfig` (its validators decide which
PCP/DCP/DP topologies exist; some it refuses, and the refusal is part of the case),
`CacheConfig`, `KVTransferConfig`, `KVEventsConfig` and the `kv_cache_interface` specs
of every type, grouped as real models group them (dense, GQA, MLA, sliding-window and
chunked-local hybrids, Mamba hybrids, attention-free models reporting 0 KV heads,
encoder-decoder, HiSparse) plus random mixes. The extra config holds junk of every JSON
type where vLLM parses integers. Only `VllmConfig` and `ModelConfig` are stand-ins
(neither builds on a CPU-only machine): they expose exactly the attributes vLLM reads.

`draw_case(rng)` returns a `Case`; `Case.vllm_config(log)` builds the `VllmConfig`
stand-in whose config objects record every attribute read into `log`, so a test can
compare what vLLM's function reads with what ours reads.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
from fractions import Fraction
from typing import Any

import torch
from vllm.config import CacheConfig, KVEventsConfig, KVTransferConfig, ParallelConfig
from vllm.v1 import kv_cache_interface as kci
from vllm.v1.executor import Executor

TORCH_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8)
QUANT = (
    [kci.KVQuantMode.NONE] * 6
    + [kci.KVQuantMode.FP8_PER_TENSOR, kci.KVQuantMode.INT8_PER_TOKEN_HEAD]
    + [kci.KVQuantMode.FP8_PER_TOKEN_HEAD, kci.KVQuantMode.NVFP4]
)
LAYOUTS = (None, None, None, "LBHNC", "BLHNC", "LBNHC", "NHD", "HND", "custom-layout")


class CustomExecutor(Executor):
    """An Executor class given as `distributed_executor_backend` (never "mp")."""


class Recorder:
    """Forwards attribute reads to `target` and logs `(name, attribute)` for each."""

    def __init__(self, name: str, target: Any, log: set) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_log", log)

    def __getattr__(self, attr: str) -> Any:
        self._log.add((self._name, attr))
        return getattr(self._target, attr)


@dataclasses.dataclass
class ModelStandIn:
    """What vLLM's function reads of `ModelConfig` (which needs a model download)."""

    model: str
    dtype: torch.dtype
    use_mla: bool
    max_model_len: int
    total_num_kv_heads: int

    def get_total_num_kv_heads(self) -> int:
        return self.total_num_kv_heads


@dataclasses.dataclass
class Case:
    """One input: vLLM objects (or the error vLLM's validators raised building them)."""

    seed: str
    parallel: Any  # ParallelConfig, or the exception its validators raised
    parallel_kwargs: dict
    cache: CacheConfig
    model: ModelStandIn
    transfer: KVTransferConfig | None
    events: KVEventsConfig | None
    use_v2_model_runner: bool
    kv: kci.KVCacheConfig
    archetype: str

    def vllm_config(self, log: set) -> Any:
        """A `VllmConfig` stand-in whose sub-configs log every attribute read."""

        def rec(name: str, obj: Any) -> Any:
            return None if obj is None else Recorder(name, obj, log)

        namespace = _Namespace(
            model_config=rec("model_config", self.model),
            cache_config=rec("cache_config", self.cache),
            parallel_config=rec("parallel_config", self.parallel),
            kv_transfer_config=rec("kv_transfer_config", self.transfer),
            kv_events_config=rec("kv_events_config", self.events),
            use_v2_model_runner=self.use_v2_model_runner,
        )
        return Recorder("vllm_config", namespace, log)

    def describe(self) -> str:
        p = self.parallel_kwargs
        groups = [
            f"{type(g.kv_cache_spec).__name__}(bs={g.kv_cache_spec.block_size})"
            for g in self.kv.kv_cache_groups
        ]
        extra = None if self.transfer is None else self.transfer.kv_connector_extra_config
        return (
            f"archetype={self.archetype} parallel={p} cache_block={self.cache.block_size} "
            f"prefix_caching={self.cache.enable_prefix_caching} "
            f"unit={self.cache.prefix_match_unit} cache_dtype={self.cache.cache_dtype} "
            f"heads={self.model.total_num_kv_heads} mla={self.model.use_mla} groups={groups} "
            f"num_blocks={self.kv.num_blocks} tensors={len(self.kv.kv_cache_tensors)} "
            f"hisparse={self.kv.hisparse_host_num_blocks} replicas={self.kv.kv_tp_replicas} "
            f"extra={_short(extra)}"
        )


class _Namespace:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) < 300 else text[:297] + "..."


# ---------------------------------------------------------------------------- parallel


def draw_parallel(rng: random.Random) -> tuple[Any, dict]:
    """A vLLM `ParallelConfig` over PCP/DCP/DP/PP/TP, or the error its validators raise."""
    tp = rng.choice([1, 1, 2, 3, 4, 8])
    pp = rng.choice([1, 1, 1, 2])
    pcp = rng.choice([1, 1, 1, 2, 4])
    if rng.random() < 0.92:
        valid = [d for d in range(1, tp + 1) if tp % d == 0] if pcp == 1 else [1, pcp, tp * pcp]
        dcp = rng.choice(valid)
    else:
        dcp = rng.choice([1, 2, 3, 4, 6, 8, 16, 32])
    dp = rng.choice([1, 1, 1, 2, 4])
    kwargs: dict[str, Any] = dict(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        prefill_context_parallel_size=pcp,
        decode_context_parallel_size=dcp,
    )
    backend = rng.choice([None, None, "mp", "uni", "external_launcher", CustomExecutor])
    if backend is not None:
        kwargs["distributed_executor_backend"] = backend
    if dp > 1:
        local = rng.choice([d for d in range(1, dp + 1) if dp % d == 0])
        kwargs.update(
            data_parallel_size=dp,
            data_parallel_rank=rng.randrange(dp),
            data_parallel_size_local=local,
            data_parallel_external_lb=rng.random() < 0.3,
        )
        if rng.random() < 0.5:
            kwargs["data_parallel_rank_local"] = rng.randrange(local)
    if rng.random() < 0.25:
        # Several nodes: nnodes_within_dp then depends on the DP layout and raises
        # when the node count does not divide into DP node groups.
        kwargs["nnodes"] = rng.choice([2, 3, 4])
    try:
        parallel = ParallelConfig(**kwargs)
    except Exception as exc:  # vLLM's validators refused the topology
        return exc, kwargs
    parallel.rank = rng.randrange(parallel.world_size)
    if rng.random() < 0.05:
        parallel.distributed_executor_backend = "ray"  # refused without ray at construction
    return parallel, kwargs


# ---------------------------------------------------------------------------- specs


def _attention_common(rng: random.Random, bs: int, heads: int, mla: bool = False) -> dict:
    dtype = rng.choice(TORCH_DTYPES)
    common: dict[str, Any] = dict(
        block_size=bs,
        num_kv_heads=1 if mla else heads,
        head_size=rng.choice([576, 512, 128] if mla else [64, 128, 80]),
        dtype=dtype,
        kv_quant_mode=rng.choice(QUANT),
    )
    roll = rng.random()
    if roll < 0.08 and not mla:
        common["head_size_v"] = rng.choice([64, 128])
    elif roll < 0.14:
        common["num_head_slots"] = 2 * common["num_kv_heads"]
    elif roll < 0.2:
        common["state_content_bytes"] = rng.choice([656, 352, 64])
    if mla and rng.random() < 0.3:
        common["tokens_per_state"] = rng.choice([2, 4])
    elif not mla and rng.random() < 0.05:
        common["tokens_per_state"] = Fraction(1, 2)
    if rng.random() < 0.05:
        common["dcp_sharded"] = False
    return common


def _pad(rng: random.Random, spec: Any) -> Any:
    # Backends pad pages for alignment; rarely a padding below the page (vLLM asserts
    # only when the page size is read).
    roll = rng.random()
    if roll < 0.1:
        return dataclasses.replace(spec, page_size_padded=spec.real_page_size_bytes + 64)
    if roll < 0.12 and spec.real_page_size_bytes > 1:
        return dataclasses.replace(spec, page_size_padded=spec.real_page_size_bytes - 1)
    return spec


def full(rng: random.Random, bs: int, heads: int) -> Any:
    cls = rng.choice([kci.FullAttentionSpec] * 6 + [kci.SinkFullAttentionSpec, kci.RSWASpec])
    extra: dict[str, Any] = {}
    if cls is kci.RSWASpec:
        extra["rswa_window"] = rng.choice([128, 1024])
    elif cls is kci.SinkFullAttentionSpec:
        extra["sink_len"] = rng.choice([None, 4])
    elif rng.random() < 0.1:
        extra["sliding_window"] = 4096  # recorded, still full attention
    return _pad(rng, cls(**_attention_common(rng, bs, heads), **extra))


def mla(rng: random.Random, bs: int) -> Any:
    cls = rng.choice([kci.MLAAttentionSpec] * 5 + [kci.HiddenStateCacheSpec])
    extra: dict[str, Any] = {}
    if rng.random() < 0.2:
        extra["alignment"] = rng.choice([576, 512, 128])
    return _pad(rng, cls(**_attention_common(rng, bs, 1, mla=True), **extra))


def window(rng: random.Random, bs: int, heads: int) -> Any:
    roll = rng.random()
    if roll < 0.15:
        common = _attention_common(rng, bs, 1, mla=True)
        common.pop("tokens_per_state", None)
        return kci.SlidingWindowMLASpec(
            **common,
            sliding_window=rng.choice([128, 512]),
            bounded_replay=rng.random() < 0.3,
        )
    win = 0 if rng.random() < 0.03 else rng.choice([1, 7, 64, 128, 500, 4096])
    return kci.SlidingWindowSpec(
        **_attention_common(rng, bs, heads),
        sliding_window=win,
        extra_retained_tokens=rng.choice([0, 0, 3, 16]),
    )


def chunked(rng: random.Random, bs: int, heads: int) -> Any:
    size = 0 if rng.random() < 0.03 else rng.choice([100, 1024, 8192])
    return kci.ChunkedLocalAttentionSpec(
        **_attention_common(rng, bs, heads), attention_chunk_size=size
    )


def other_attention(rng: random.Random, bs: int, heads: int) -> Any:
    cls = rng.choice([kci.CircularBufferSpec, kci.EncoderOnlyAttentionSpec, kci.CrossAttentionSpec])
    return cls(**_attention_common(rng, bs, heads))


def mamba(rng: random.Random, bs: int) -> Any:
    shapes = tuple((rng.choice([1, 3, 8]), rng.choice([4, 16])) for _ in range(rng.choice([1, 2])))
    dtypes = tuple(rng.choice([torch.float32, torch.bfloat16, torch.float16]) for _ in shapes)
    spec = kci.MambaSpec(
        block_size=bs,
        shapes=shapes,
        dtypes=dtypes,
        mamba_cache_mode=rng.choice(["none", "align", "align"]),
    )
    return _pad(rng, spec)


def hisparse(rng: random.Random, bs: int) -> Any:
    if rng.random() < 0.5:
        return kci.HiSparseHotSpec(block_size=bs, page_size=4096, blocks_per_request=8)
    return kci.HiSparseResidentSpec(block_size=bs, page_size=4096)


def uniform(rng: random.Random, bs: int, heads: int) -> Any:
    # DeepSeek-V3.2 style: an MLA layer with its indexer, one spec per layer.
    make = rng.choice([lambda: mla(rng, bs), lambda: full(rng, bs, heads)])
    specs = {f"u{i}": make() for i in range(rng.choice([1, 2, 3]))}
    return kci.UniformTypeKVCacheSpecs(block_size=bs, kv_cache_specs=specs)


def any_spec(rng: random.Random, bs: int, heads: int) -> Any:
    kind = rng.choice(
        ["full", "full", "mla", "window", "chunked", "other", "mamba", "hisparse", "uniform"]
    )
    if kind == "full":
        return full(rng, bs, heads)
    if kind == "mla":
        return mla(rng, bs)
    if kind == "window":
        return window(rng, bs, heads)
    if kind == "chunked":
        return chunked(rng, bs, heads)
    if kind == "other":
        return other_attention(rng, bs, heads)
    if kind == "mamba":
        return mamba(rng, bs)
    if kind == "hisparse":
        return hisparse(rng, bs)
    return uniform(rng, bs, heads)


def _block(rng: random.Random, bs: int) -> int:
    # Mostly the cache block size, so that translations often succeed.
    roll = rng.random()
    if roll < 0.7:
        return bs
    if roll < 0.98:
        return rng.choice([bs * 2, bs * 4, max(1, bs // 2), 12, 16, 64, 1152])
    return 0  # a degenerate spec vLLM's classes accept


ARCHETYPES = (
    "dense",
    "gqa",
    "mla",
    "swa_hybrid",
    "chunked_hybrid",
    "mamba_hybrid",
    "attention_free",
    "encoder_decoder",
    "dsv32",
    "hisparse",
    "mix",
    "no_groups",
)


def draw_groups(rng: random.Random, archetype: str, bs: int, heads: int, tp: int) -> list:
    """`(spec, n_layers)` pairs for a model of the given archetype."""
    local = max(1, heads // max(tp, 1)) if heads else 1
    b = lambda: _block(rng, bs)  # noqa: E731
    if archetype == "dense":
        return [(full(rng, b(), heads if rng.random() < 0.2 else local), 4)]
    if archetype == "gqa":
        return [(full(rng, b(), local), 2)]
    if archetype == "mla":
        return [(mla(rng, b()), 3)]
    if archetype == "swa_hybrid":
        return [(full(rng, b(), local), 2), (window(rng, b(), local), 2)]
    if archetype == "chunked_hybrid":
        return [(chunked(rng, b(), local), 3), (full(rng, b(), local), 1)]
    if archetype == "mamba_hybrid":
        groups = [(mamba(rng, b()), 3), (full(rng, b(), local), 1)]
        return groups if rng.random() < 0.5 else groups[::-1]
    if archetype == "attention_free":
        return [(mamba(rng, b()), 4)] * rng.choice([1, 2])
    if archetype == "encoder_decoder":
        return [(full(rng, b(), local), 2), (other_attention(rng, b(), local), 2)]
    if archetype == "dsv32":
        return [(uniform(rng, b(), local), 2)]
    if archetype == "hisparse":
        return [(hisparse(rng, b()), 2), (mla(rng, b()), 2)]
    if archetype == "mix":
        return [
            (any_spec(rng, b(), local), rng.choice([1, 2])) for _ in range(rng.choice([1, 2, 3]))
        ]
    return []


def draw_kv_cache_config(
    rng: random.Random, archetype: str, bs: int, heads: int, tp: int
) -> kci.KVCacheConfig:
    groups = []
    for i, (spec, n_layers) in enumerate(draw_groups(rng, archetype, bs, heads, tp)):
        if isinstance(spec, kci.UniformTypeKVCacheSpecs):
            names = [f"g{i}.{name}" for name in spec.kv_cache_specs]
            spec = dataclasses.replace(
                spec, kv_cache_specs=dict(zip(names, spec.kv_cache_specs.values()))
            )
        else:
            names = [f"g{i}.l{j}" for j in range(n_layers)]
        role = kci.KVCacheGroupRole.DEFAULT
        if archetype == "hisparse":
            # The host-resident source first, its indexer second (mostly).
            roles = [kci.KVCacheGroupRole.HISPARSE_SOURCE, kci.KVCacheGroupRole.HISPARSE_INDEXER]
            role = roles[i] if rng.random() < 0.8 else rng.choice(list(kci.KVCacheGroupRole))
        elif rng.random() < 0.05:
            role = rng.choice(list(kci.KVCacheGroupRole))
        groups.append(
            kci.KVCacheGroupSpec(
                layer_names=names,
                kv_cache_spec=spec,
                enable_kv_transfer=rng.random() > 0.07,
                host_resident=rng.random() < 0.03,
                role=role,
            )
        )
    num_blocks = rng.choice([0, 1, 4, 100, 100])
    tensors = []
    if groups and num_blocks and rng.random() < 0.5:
        # One backing allocation: each tensor's size is the whole of it (+ padding).
        layers = [n for g in groups for n in g.layer_names]
        page = max(_page_or_zero(g.kv_cache_spec) for g in groups) or 64
        size = page * len(layers) * num_blocks + rng.choice([0, 0, 128])
        for k in range(rng.choice([1, 1, 2])):
            tensors.append(
                kci.KVCacheTensor(
                    size=size,
                    layers=layers,
                    layer_stride=page * num_blocks,
                    block_stride=page,
                    offset=k * page,
                )
            )
    hisparse_blocks = rng.choice([None] * 30 + [4]) if archetype != "hisparse" else 4
    return kci.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        hisparse_host_num_blocks=hisparse_blocks,
        kv_tp_replicas=rng.choice([1, 1, tp, 2]),
    )


def _page_or_zero(spec: Any) -> int:
    try:
        return spec.page_size_bytes
    except AssertionError:  # padding below the page: vLLM's property asserts
        return 0


# ---------------------------------------------------------------------------- extra


def junk(rng: random.Random) -> Any:
    """A value of any JSON type (and a few Python ones) where vLLM calls `int()`."""
    kind = rng.random()
    if kind < 0.25:  # containers: int() raises TypeError
        return rng.choice([[], [2], {}, {"a": 1}, (4,), [{"medium": "disk"}], {"n": [1]}])
    if kind < 0.6:
        ints = [None, True, False, 0, 1, 2, 4, -1, -16, 16, 32, 48, 64, 40, 10**30]
        return rng.choice([*ints, 2.0, 64.0, 2.5, -0.5, math.nan, math.inf, -math.inf])
    return rng.choice(
        ["64", " 8 ", "4", "0", "-16", "0x10", "1e3", "2.0", "x", "", "9" * 5000, "1_6"]
    )


def draw_extra(rng: random.Random, bs: int) -> dict:
    extra: dict[str, Any] = {}
    roll = rng.random()
    if roll < 0.35:
        extra["blocks_per_chunk"] = rng.choice([1, 2, 4, "2"]) if rng.random() < 0.6 else junk(rng)
    elif roll < 0.7:
        value = rng.choice([bs, 2 * bs, 4 * bs, 64]) if rng.random() < 0.6 else junk(rng)
        extra["block_size"] = value
    elif roll < 0.75:
        extra["blocks_per_chunk"], extra["block_size"] = junk(rng), junk(rng)
    if rng.random() < 0.35:
        extra["canonical_layout"] = rng.choice([True, False, "false", "", 0, 1, None, [], {}])
    if rng.random() < 0.5:
        extra["cpu_bytes_to_use"] = rng.choice([1 << 30, "8e9", -1])
    if rng.random() < 0.2:
        extra["secondary_tiers"] = [{"medium": "disk", "path": "/x", "backpressure": {}}]
    if rng.random() < 0.1:
        extra["deep"] = {"a": [{"b": [1, 2, (3,)]}], "n": float("nan")}
    return extra


# ---------------------------------------------------------------------------- cases


def draw_case(rng: random.Random, seed: str) -> Case:
    parallel, parallel_kwargs = draw_parallel(rng)
    tp = parallel_kwargs["tensor_parallel_size"]
    bs = rng.choice([1, 4, 8, 12, 16, 16, 16, 32, 64])
    cache = CacheConfig(
        block_size=bs,
        cache_dtype=rng.choice(["auto", "auto", "float16", "bfloat16", "fp8", "fp8_e4m3",
                                "int8_per_token_head", "nvfp4", "turboquant_k8v4"]),
        enable_prefix_caching=rng.random() < 0.7,
        prefix_match_unit=rng.choice([None] * 16 + [1, 4, 8, 16, bs, bs]),
    )  # fmt: skip
    cache.kv_cache_layout = rng.choice(LAYOUTS)
    # An engine with no KV cache groups is a corner case: draw it rarely.
    archetype = rng.choice(ARCHETYPES[:-1]) if rng.random() > 0.03 else "no_groups"
    heads = 0 if archetype == "attention_free" else rng.choice([1, 2, 4, 8, 8, 16, 3])
    if archetype == "attention_free" or rng.random() < 0.03:
        heads = 0
    model = ModelStandIn(
        model=rng.choice(["m", "org/model-7b"]),
        dtype=rng.choice([torch.float16, torch.bfloat16, torch.float32]),
        use_mla=archetype in ("mla", "dsv32") or rng.random() < 0.1,
        max_model_len=rng.choice([0, 4096, 131072]),
        total_num_kv_heads=heads,
    )
    transfer = None
    if rng.random() > 0.02:
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=draw_extra(rng, bs),
            engine_id=rng.choice(["engine-0", "engine-0_dp1", None]),
        )
        if rng.random() < 0.02:
            transfer.engine_id = None  # vLLM fills one in; cleared it asserts
    events = rng.choice([None, KVEventsConfig(enable_kv_cache_events=rng.random() < 0.5)])
    return Case(
        seed=seed,
        parallel=parallel,
        parallel_kwargs=parallel_kwargs,
        cache=cache,
        model=model,
        transfer=transfer,
        events=events,
        use_v2_model_runner=rng.random() < 0.2,
        kv=draw_kv_cache_config(rng, archetype, bs, heads, tp),
        archetype=archetype,
    )


def external_launcher_env() -> None:
    """vLLM's external launcher reads the torchrun RANK when DP > 1."""
    os.environ.setdefault("RANK", "0")
