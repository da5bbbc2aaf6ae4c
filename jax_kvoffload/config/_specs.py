"""KV cache specs: the per-layer description the translation reads (vLLM 0.33.0's model).

Mirrors `vllm/v1/kv_cache_interface.py`: the same classes, the same inheritance (the
translation dispatches on it with `isinstance` and, in one place, on the exact type), the
same field defaults and the same page-size formulas (`page_size_bytes`). Dtypes are numpy
dtypes instead of torch dtypes; every field is keyword-only.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from jax_kvoffload.config import _validate as v
from jax_kvoffload.config._dtypes import as_dtype
from jax_kvoffload.config._errors import ConfigFieldError
from jax_kvoffload.config._frozen import FrozenDict


def round_up(x: int, y: int) -> int:
    return ((x + y - 1) // y) * y


class KVQuantMode(enum.IntEnum):
    """KV cache quantisation modes. `CUSTOM` is an alias of `OCTAVE_K3V4`, as in vLLM."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4
    NVFP4 = 5
    TURBOQUANT_K8V4 = 6
    TURBOQUANT_4BIT_NC = 7
    TURBOQUANT_K3V4_NC = 8
    TURBOQUANT_3BIT_NC = 9
    NVFP4_DS_MLA = 10
    ULTRAQUANT_4BIT = 11
    OCTAVE_K3V4 = 12
    OCTAVE_K3V3 = 13
    OCTAVE_K3V3_COMPACT = 14
    CUSTOM = 12

    @property
    def is_per_token_head(self) -> bool:
        """Scales stored per token and head: pages are not head-shardable bytes."""
        return self in _PER_TOKEN_HEAD


_PER_TOKEN_HEAD = frozenset(
    {
        KVQuantMode.INT8_PER_TOKEN_HEAD,
        KVQuantMode.FP8_PER_TOKEN_HEAD,
        KVQuantMode.INT4_PER_TOKEN_HEAD,
    }
)


def _check_padding(spec: KVCacheSpec) -> None:
    # vLLM asserts page_size_padded >= the real page; say which sizes and the fix.
    v.check_optional_int("page_size_padded", spec.page_size_padded, minimum=1)
    if spec.page_size_padded is not None and spec.page_size_padded < spec.real_page_size_bytes:
        raise ConfigFieldError(
            "page_size_padded",
            f"{spec.page_size_padded} is smaller than the real page "
            f"({spec.real_page_size_bytes} bytes); use at least that",
        )


def kv_quant_mode_for(cache_dtype: str) -> KVQuantMode:
    """vLLM's `get_kv_quant_mode`: the mode a `cache_dtype` string implies."""
    if cache_dtype in ("int4_per_token_head", "int8_per_token_head", "fp8_per_token_head"):
        return KVQuantMode[cache_dtype.upper()]
    if cache_dtype == "nvfp4_ds_mla":  # before the nvfp4 prefix
        return KVQuantMode.NVFP4_DS_MLA
    if cache_dtype.startswith("nvfp4"):
        return KVQuantMode.NVFP4
    if cache_dtype.startswith(("turboquant_", "octave_")):
        try:
            return KVQuantMode[cache_dtype.upper()]
        except KeyError:
            raise ConfigFieldError("cache_dtype", f"unknown quantisation {cache_dtype!r}") from None
    if cache_dtype == "ultraquant_4bit":
        return KVQuantMode.ULTRAQUANT_4BIT
    if cache_dtype.startswith("fp8"):
        return KVQuantMode.FP8_PER_TENSOR
    return KVQuantMode.NONE


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec(abc.ABC):
    """Base of every spec. `block_size` is in tokens per block on one worker."""

    block_size: int
    dcp_sharded: bool = False
    block_stride_alignment: int | None = None
    is_draft: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        v.check_int("block_size", self.block_size, minimum=1)
        v.check_bool("dcp_sharded", self.dcp_sharded)
        v.check_optional_int("block_stride_alignment", self.block_stride_alignment, minimum=1)

    @property
    def prefix_cacheable(self) -> bool:
        return True

    @property
    @abc.abstractmethod
    def page_size_bytes(self) -> int:
        """Bytes one layer allocates per block (padding included)."""


class _PaddedPage:
    """`page_size_bytes` of a spec with `page_size_padded` over its `real_page_size_bytes`."""

    page_size_padded: int | None
    real_page_size_bytes: int

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(_PaddedPage, KVCacheSpec):
    """Paged attention KV: `num_heads * num_states * state_content_size_bytes` per page."""

    dcp_sharded: bool = True
    max_tp_shards: int | None = None
    num_kv_heads: int
    head_size: int
    dtype: np.dtype
    head_size_v: int | None = None
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE
    page_size_padded: int | None = None
    num_head_slots: int | None = None
    state_content_bytes: int | None = None
    tokens_per_state: int | Fraction = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        v.check_int("num_kv_heads", self.num_kv_heads, minimum=1)
        v.check_int("head_size", self.head_size, minimum=0)
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        v.check_int("head_size_v", self.head_size_v, minimum=0)
        object.__setattr__(self, "kv_quant_mode", KVQuantMode(self.kv_quant_mode))
        v.check_optional_int("num_head_slots", self.num_head_slots, minimum=1)
        v.check_optional_int("state_content_bytes", self.state_content_bytes, minimum=1)
        v.check_ratio("tokens_per_state", self.tokens_per_state)
        _check_padding(self)

    @property
    def num_heads(self) -> int:
        return self.num_head_slots if self.num_head_slots is not None else self.num_kv_heads

    @property
    def num_states(self) -> int:
        if self.tokens_per_state > 0:
            return int(self.block_size // self.tokens_per_state)
        return 1

    @property
    def state_content_size_bytes(self) -> int:
        if self.state_content_bytes is not None:
            return self.state_content_bytes
        return (self.head_size + self.head_size_v) * self.dtype.itemsize

    @property
    def real_page_size_bytes(self) -> int:
        return self.num_heads * self.num_states * self.state_content_size_bytes


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Full attention. A recorded `sliding_window` does not make it a window spec."""

    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    non_causal: bool = False


def _pad_to_alignment(spec: AttentionSpec, alignment: int | None) -> None:
    # vLLM's MLA post-init: pad the page up to `alignment` when that changes its size.
    v.check_optional_int("alignment", alignment, minimum=1)
    if alignment is not None:
        padded = round_up(spec.real_page_size_bytes, alignment)
        if padded != spec.real_page_size_bytes:
            object.__setattr__(spec, "page_size_padded", padded)


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent per state (`head_size_v` defaults to 0)."""

    num_kv_heads: int = 1
    head_size_v: int | None = 0
    cache_dtype_str: str | None = None
    topk_buffer_width: int | None = None
    alignment: int | None = None
    model_version: str | None = None
    cache_role: str = "sparse"
    is_index_group_leader: bool = False
    non_causal_multi_token_decode: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _pad_to_alignment(self, self.alignment)


@dataclass(frozen=True, kw_only=True)
class HiddenStateCacheSpec(MLAAttentionSpec):
    """Marker subclass of MLA (hidden-state caches); never canonically certifiable."""


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention keeping `sliding_window` (+ retained) tokens."""

    sliding_window: int
    extra_retained_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        v.check_int("sliding_window", self.sliding_window, minimum=1)
        v.check_int("extra_retained_tokens", self.extra_retained_tokens, minimum=0)


@dataclass(frozen=True, kw_only=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """Sliding-window MLA; bounded replay makes it non-prefix-cacheable."""

    num_kv_heads: int = 1
    head_size_v: int | None = 0
    cache_dtype_str: str | None = None
    alignment: int | None = None
    model_version: str | None = None
    bounded_replay: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.model_version not in (None, "deepseek_v4"):
            raise ConfigFieldError(
                "model_version", f"must be None or 'deepseek_v4', got {self.model_version!r}"
            )
        _pad_to_alignment(self, self.alignment)

    @property
    def prefix_cacheable(self) -> bool:
        return not self.bounded_replay


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention over `attention_chunk_size` tokens."""

    attention_chunk_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        v.check_int("attention_chunk_size", self.attention_chunk_size, minimum=1)


@dataclass(frozen=True, kw_only=True)
class CircularBufferSpec(AttentionSpec):
    """A ring buffer of KV: not prefix cacheable, so never offloaded by 0.33.0."""

    @property
    def prefix_cacheable(self) -> bool:
        return False


@dataclass(frozen=True, kw_only=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Encoder-only attention."""


@dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Encoder-decoder cross attention."""


@dataclass(frozen=True, kw_only=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with attention sinks."""

    sink_len: int | None = None


@dataclass(frozen=True, kw_only=True)
class RSWASpec(FullAttentionSpec):
    """Full attention with a recorded `rswa_window`."""

    rswa_window: int | None = None


@dataclass(frozen=True, kw_only=True)
class MambaSpec(_PaddedPage, KVCacheSpec):
    """Recurrent state: one page holds every state tensor of `shapes` / `dtypes`."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    page_size_padded: int | None = None
    mamba_type: str = "mamba2"
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None
    num_heads: int = 1
    tokens_per_state: int = -1
    tp_replicated: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        shapes = tuple(tuple(v.check_int("shapes[]", d, minimum=0) for d in s) for s in self.shapes)
        dtypes = tuple(as_dtype(d, "dtypes[]") for d in self.dtypes)
        if len(shapes) != len(dtypes):
            raise ConfigFieldError(
                "dtypes", f"has {len(dtypes)} entries but shapes has {len(shapes)}"
            )
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", dtypes)
        if self.mamba_cache_mode not in ("none", "align", "all"):
            raise ConfigFieldError(
                "mamba_cache_mode",
                f"must be 'none', 'align' or 'all', got {self.mamba_cache_mode!r}",
            )
        _check_padding(self)

    @property
    def real_page_size_bytes(self) -> int:
        return sum(
            int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            for shape, dtype in zip(self.shapes, self.dtypes, strict=True)
        )


@dataclass(frozen=True, kw_only=True)
class _HiSparseSpec(KVCacheSpec):
    page_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        v.check_int("page_size", self.page_size, minimum=1)

    @property
    def prefix_cacheable(self) -> bool:
        return False

    @property
    def real_page_size_bytes(self) -> int:
        return self.page_size

    @property
    def page_size_bytes(self) -> int:
        return self.page_size


@dataclass(frozen=True, kw_only=True)
class HiSparseHotSpec(_HiSparseSpec):
    """HiSparse device-hot pages (not prefix cacheable)."""

    blocks_per_request: int | None = None


@dataclass(frozen=True, kw_only=True)
class HiSparseResidentSpec(_HiSparseSpec):
    """HiSparse host-resident pages (not prefix cacheable)."""


@dataclass(frozen=True, kw_only=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """One spec per layer for a group whose layers share a type but not a page size.

    `kv_cache_specs` maps layer name to spec (order kept); `dcp_sharded` is copied from
    the first inner spec. There is deliberately no `real_page_size_bytes`, as in vLLM.
    """

    kv_cache_specs: Mapping[str, KVCacheSpec]

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.kv_cache_specs, Mapping) or not self.kv_cache_specs:
            raise ConfigFieldError("kv_cache_specs", "must be a non-empty mapping of layer -> spec")
        for name, spec in self.kv_cache_specs.items():
            if not isinstance(spec, KVCacheSpec) or isinstance(spec, UniformTypeKVCacheSpecs):
                raise TypeError(f"kv_cache_specs[{name!r}] must be a per-layer spec, got {spec!r}")
        object.__setattr__(self, "kv_cache_specs", FrozenDict(self.kv_cache_specs))
        first = next(iter(self.kv_cache_specs.values()))
        object.__setattr__(self, "dcp_sharded", first.dcp_sharded)

    @property
    def prefix_cacheable(self) -> bool:
        return all(spec.prefix_cacheable for spec in self.kv_cache_specs.values())

    @property
    def page_size_bytes(self) -> int:
        return sum(spec.page_size_bytes for spec in self.kv_cache_specs.values())


def iter_layer_specs(spec: KVCacheSpec) -> Iterator[KVCacheSpec]:
    """The per-layer specs of a group's spec: the inner specs of a wrapper, else itself."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        yield from spec.kv_cache_specs.values()
    else:
        yield spec
