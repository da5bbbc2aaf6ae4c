"""Shared builders for the canonical-mapping tests: the inputs of vLLM's
tests/v1/kv_connector/unit/offloading_connector/test_canonical_mapping.py.

`fs(h)` = full attention (block 4, h heads, head 64, int8: page 1024 B for h=2), `ms()` =
MLA (block 4, head 64, int8: page 256 B); `FORMS` are the four certified physical layouts
of a 3-block cache; `ctx(...)` is a rank context whose total KV heads default to 2*tp.
"""

from __future__ import annotations

from typing import Any

from jax_kvoffload.config import FullAttentionSpec, MLAAttentionSpec
from jax_kvoffload.config.canonical import KVTensorView, RankContext

NUM_BLOCKS = 3


def fs(h: int = 2, **kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=4, num_kv_heads=h, head_size=64, dtype="int8", **kw)


def ms(hs: int = 64, **kw: Any) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=4, head_size=hs, dtype="int8", **kw)


def form(name: str, h: int, *, bs: int = 4, hs: int = 64, itemsize: int = 1) -> KVTensorView:
    kind, order = name.split("-")
    make = KVTensorView.split if kind == "split" else KVTensorView.packed
    return make(NUM_BLOCKS, h, bs, hs, itemsize, order)


FORMS = ("split-nhd", "split-hnd", "packed-nhd", "packed-hnd")


def ctx(
    rank: int, tp: int, dcp: int = 1, pcp: int = 1, interleave: int = 1, total: int | None = None
) -> RankContext:
    return RankContext(
        tp_size=tp,
        dcp_size=dcp,
        pcp_size=pcp,
        interleave=interleave,
        total_kv_heads=2 * tp if total is None else total,
        rank=rank,
    )


def triples(mapping) -> list[tuple[int, int, int]]:
    return mapping.fragments()
