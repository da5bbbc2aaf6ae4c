"""KV cache specs: the per-layer description the translation reads (vLLM 0.33.0's model).

Mirrors `vllm/v1/kv_cache_interface.py`: the same classes, the same inheritance (the
translation dispatches on it with `isinstance` and, in one place, on the exact type), the
same field defaults and the same page-size formulas (`page_size_bytes`). Dtypes are numpy
dtypes instead of torch dtypes; every field is keyword-only.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np

from jax_kvoffload.config import _validate as v
from jax_kvoffload.config._dtypes import as_dtype
from jax_kvoffload.config._errors import ConfigFieldError, ConfigTypeError
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


class _Padded(Protocol):
    """A spec whose page may be padded (attention and MLA specs)."""

    @property
    def page_size_padded(self) -> int | None: ...

    @property
    def real_page_size_bytes(self) -> int: ...


def _check_padding(spec: _Padded) -> None:
    # vLLM asserts page_size_padded >= the real page (when the page size is read); say
    # which sizes and the fix.
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
            known = sorted(
                m.name.lower() for m in KVQuantMode if m.name.startswith(("TURBO", "OCT"))
            )
            raise ConfigFieldError(
                "cache_dtype", f"unknown quantisation {cache_dtype!r}; use one of {known}"
            ) from None
    if cache_dtype == "ultraquant_4bit":
        return KVQuantMode.ULTRAQUANT_4BIT
    if cache_dtype.startswith("fp8"):
        return KVQuantMode.FP8_PER_TENSOR
    return KVQuantMode.NONE


def _quant_mode(value: object) -> KVQuantMode:
    if not v.is_int(value):
        raise ConfigTypeError("kv_quant_mode", f"must be a KVQuantMode, got {type(value).__name__}")
    try:
        return KVQuantMode(int(value))
    except ValueError:
        raise ConfigFieldError(
            "kv_quant_mode", f"{v.show(value)} is no KVQuantMode; use e.g. KVQuantMode.NONE"
        ) from None


def _sequence(field: str, value: object) -> tuple[object, ...]:
    if isinstance(value, (str, set, frozenset, Mapping)) or not isinstance(value, Iterable):
        raise ConfigTypeError(field, f"must be a tuple, got {type(value).__name__}")
    return tuple(value)


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec(abc.ABC):
    """Base of every spec. `block_size` is in tokens per block on one worker."""

    block_size: int
    dcp_sharded: bool = False
    block_stride_alignment: int | None = None
    is_draft: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        v.int_fields(self, "block_size", minimum=1)
        v.bool_fields(self, "dcp_sharded", "is_draft")
        v.optional_int_fields(self, "block_stride_alignment", minimum=1)

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
    if TYPE_CHECKING:

        @property
        def real_page_size_bytes(self) -> int: ...

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            _check_padding(self)
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
        v.int_fields(self, "num_kv_heads", minimum=1)
        v.int_fields(self, "head_size", minimum=0)
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        v.int_fields(self, "head_size_v", minimum=0)
        object.__setattr__(self, "kv_quant_mode", _quant_mode(self.kv_quant_mode))
        v.optional_int_fields(self, "max_tp_shards", "num_head_slots", minimum=1)
        v.optional_int_fields(self, "state_content_bytes", "page_size_padded", minimum=1)
        object.__setattr__(
            self, "tokens_per_state", v.check_ratio("tokens_per_state", self.tokens_per_state)
        )
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
        return (self.head_size + cast(int, self.head_size_v)) * self.dtype.itemsize

    @property
    def real_page_size_bytes(self) -> int:
        return self.num_heads * self.num_states * self.state_content_size_bytes


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Full attention. A recorded `sliding_window` does not make it a window spec."""

    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    non_causal: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        v.optional_int_fields(self, "sliding_window", "attention_chunk_size", minimum=1)
        v.bool_fields(self, "non_causal")


def _pad_to_alignment(spec: AttentionSpec, alignment: int | None) -> None:
    # vLLM's MLA post-init: pad the page up to `alignment` when that changes its size.
    v.optional_int_fields(spec, "alignment", minimum=1)
    alignment = spec.alignment  # type: ignore[attr-defined]
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
        v.optional_str_fields(self, "cache_dtype_str", "model_version")
        v.optional_int_fields(self, "topk_buffer_width", minimum=1)
        v.str_fields(self, "cache_role")
        v.bool_fields(self, "is_index_group_leader", "non_causal_multi_token_decode")
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
        v.int_fields(self, "sliding_window", minimum=1)
        v.int_fields(self, "extra_retained_tokens", minimum=0)


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
        v.optional_str_fields(self, "cache_dtype_str", "model_version")
        v.bool_fields(self, "bounded_replay")
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
        v.int_fields(self, "attention_chunk_size", minimum=1)


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

    def __post_init__(self) -> None:
        super().__post_init__()
        v.optional_int_fields(self, "sink_len", minimum=0)


@dataclass(frozen=True, kw_only=True)
class RSWASpec(FullAttentionSpec):
    """Full attention with a recorded `rswa_window`."""

    rswa_window: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        v.optional_int_fields(self, "rswa_window", minimum=1)


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
        shapes = tuple(
            tuple(
                v.check_int(f"shapes[{i}][{j}]", d, minimum=0)
                for j, d in enumerate(_sequence(f"shapes[{i}]", shape))
            )
            for i, shape in enumerate(_sequence("shapes", self.shapes))
        )
        dtypes = tuple(
            as_dtype(d, f"dtypes[{i}]") for i, d in enumerate(_sequence("dtypes", self.dtypes))
        )
        if len(shapes) != len(dtypes):
            raise ConfigFieldError(
                "dtypes", f"has {len(dtypes)} entries but shapes has {len(shapes)}"
            )
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", dtypes)
        if self.mamba_cache_mode not in ("none", "align", "all"):
            raise ConfigFieldError(
                "mamba_cache_mode",
                f"must be 'none', 'align' or 'all', got {v.show(self.mamba_cache_mode)}",
            )
        v.str_fields(self, "mamba_type")
        v.optional_int_fields(self, "page_size_padded", "prefill_checkpoint_alignment", minimum=1)
        v.int_fields(self, "num_speculative_blocks", "num_prefill_checkpoint_blocks", minimum=0)
        v.int_fields(self, "num_heads", "tokens_per_state")
        v.bool_fields(self, "tp_replicated")
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
        v.int_fields(self, "page_size", minimum=1)

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

    def __post_init__(self) -> None:
        super().__post_init__()
        v.optional_int_fields(self, "blocks_per_request", minimum=0)


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
        if not isinstance(self.kv_cache_specs, Mapping):
            raise ConfigTypeError(
                "kv_cache_specs",
                f"must be a dict of layer name -> spec, got {type(self.kv_cache_specs).__name__}",
            )
        if not self.kv_cache_specs:
            raise ConfigFieldError("kv_cache_specs", "is empty; give one spec per layer")
        for name, spec in self.kv_cache_specs.items():
            if not isinstance(spec, KVCacheSpec) or isinstance(spec, UniformTypeKVCacheSpecs):
                raise ConfigTypeError(
                    f"kv_cache_specs[{name!r}]",
                    f"must be a per-layer spec (not a wrapper), got {type(spec).__name__}",
                )
        specs = FrozenDict(self.kv_cache_specs, name="kv_cache_specs")
        object.__setattr__(self, "kv_cache_specs", specs)
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
