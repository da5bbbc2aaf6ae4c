"""Our canonical derivation against vLLM 0.33.0's `_layer_mapping`, on identical inputs.

Skipped unless vLLM is importable (docs/vllm.md installs it). Each case builds vLLM's spec
and a torch tensor of one of the four physical layouts (plus refused permutations), and
our spec and a `KVTensorView` with the tensor's shape, strides and element size; both
derivations must agree exactly (runs, sizes, writers, agnosticism) or both refuse.
"""

from __future__ import annotations

import itertools
import os

import pytest

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
vllm = pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import (  # noqa: E402
    canonical_mapping as vcm,
)
from vllm.v1 import kv_cache_interface as vki  # noqa: E402

from jax_kvoffload.config import FullAttentionSpec, KVQuantMode, MLAAttentionSpec  # noqa: E402
from jax_kvoffload.config.canonical import (  # noqa: E402
    KVTensorView,
    RankContext,
    canonical_format_id,
    layer_mapping,
)

pytestmark = pytest.mark.vllm

NB = 3
DTYPES = {"int8": torch.int8, "bfloat16": torch.bfloat16, "float32": torch.float32}


def tensors(h: int, bs: int, hs: int, dt: torch.dtype) -> dict[str, torch.Tensor]:
    return {
        "split-nhd": torch.empty(NB, 2, bs, h, hs, dtype=dt),
        "split-hnd": torch.empty(NB, 2, h, bs, hs, dtype=dt).permute(0, 1, 3, 2, 4),
        "packed-nhd": torch.empty(NB, bs, h, 2 * hs, dtype=dt).permute(0, 2, 1, 3),
        "packed-hnd": torch.empty(NB, h, bs, 2 * hs, dtype=dt),
        "refused-bs2h": torch.empty(NB, bs, 2, h, hs, dtype=dt).permute(0, 2, 1, 3, 4),
        "refused-flashinfer": torch.empty(NB, 2 * h, bs, hs, dtype=dt),
    }


def view_of(t: torch.Tensor) -> KVTensorView:
    return KVTensorView(tuple(t.shape), tuple(t.stride()), t.element_size())


def as_tuple(m):
    """A mapping (ours or vLLM's: the same attribute names) as plain tuples."""
    if m is None:
        return None
    runs = tuple(
        (
            r.local_offset,
            r.canonical_offset,
            r.fragment_size,
            r.num_fragments,
            r.local_stride,
            r.canonical_stride,
        )
        for r in m.runs
    )
    return (
        m.canonical_page_size_bytes,
        m.local_page_size_bytes,
        runs,
        m.num_writers,
        m.writer_index,
        m.parallelism_agnostic,
    )


def contexts():
    for tp, dcp, pcp, il, total in itertools.product(
        (1, 2, 4, 8), (1, 2), (1, 2), (1, 2, 3, 4, 8), (1, 2, 4, 8)
    ):
        if tp % dcp:
            continue
        for rank in range(tp * pcp):
            yield (tp, dcp, pcp, il, total, rank)


def compare(our_spec, their_spec, our_view, their_tensor, c) -> int:
    tp, dcp, pcp, il, total, rank = c
    ours = layer_mapping(our_spec, our_view, NB, RankContext(tp, dcp, pcp, il, total, rank))
    vctx = vcm._RankContext(tp, dcp, pcp, il, total, rank)
    want = as_tuple(vcm._layer_mapping(their_spec, their_tensor, NB, vctx))
    assert as_tuple(ours) == want, (our_spec, our_view, c)
    return int(want is not None)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("heads", [1, 2, 4])
def test_attention_sweep_matches_vllm(dtype, heads):
    bs, hs = 4, 8
    quants = (KVQuantMode.NONE, KVQuantMode.FP8_PER_TOKEN_HEAD)
    certified = 0
    for t in tensors(heads, bs, hs, DTYPES[dtype]).values():
        for q in quants:
            ours = FullAttentionSpec(
                block_size=bs, num_kv_heads=heads, head_size=hs, dtype=dtype, kv_quant_mode=q
            )
            vq = vki.KVQuantMode(int(q))
            vspec = vki.FullAttentionSpec(
                block_size=bs,
                num_kv_heads=heads,
                head_size=hs,
                dtype=DTYPES[dtype],
                kv_quant_mode=vq,
            )
            for c in contexts():
                certified += compare(ours, vspec, view_of(t), t, c)
    assert certified > 0  # the sweep exercises certified cases, not only refusals


@pytest.mark.parametrize("tps", [1, 2])
@pytest.mark.parametrize("quant", [KVQuantMode.NONE, KVQuantMode.INT8_PER_TOKEN_HEAD])
def test_mla_sweep_matches_vllm(tps, quant):
    ours = MLAAttentionSpec(
        block_size=8, head_size=24, dtype="bfloat16", tokens_per_state=tps, kv_quant_mode=quant
    )
    vspec = vki.MLAAttentionSpec(
        block_size=8,
        num_kv_heads=1,
        head_size=24,
        dtype=torch.bfloat16,
        tokens_per_state=tps,
        kv_quant_mode=vki.KVQuantMode(int(quant)),
    )
    for c in contexts():
        compare(ours, vspec, None, None, c)


def test_missing_and_listed_tensors_match_vllm():
    ours = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="int8")
    vspec = vki.FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.int8)
    t = tensors(2, 4, 8, torch.int8)["split-nhd"]
    c = (1, 1, 1, 1, 2, 0)
    compare(ours, vspec, None, None, c)
    compare(ours, vspec, [view_of(t), view_of(t)], [t, t], c)


@pytest.mark.parametrize("name", ["LBNHC", "LBHNC", "BLHNC", "LHBNC", "BLNHC", "BHLNC"])
def test_format_ids_match_vllm(name):
    assert canonical_format_id(name) == vcm.canonical_format_id(name)
