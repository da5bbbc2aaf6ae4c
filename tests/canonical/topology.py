"""Simulated topologies: shard a single-device reference cache over TP/DCP/PCP ranks, store
every rank through its `CanonicalPoolView` into one shared pool, load under another
topology, and compare bytes with the reference.

The reference ("global") cache holds every KV head and `block_size * cp` tokens per block:
exactly what one device would hold, so its pages are the canonical pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from jax_kvoffload.config import (
    CanonicalRegistration,
    EngineConfig,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    ModelConfig,
    ParallelConfig,
)
from jax_kvoffload.config.canonical import RankContext, derive_layer_mappings, rank_contexts
from jax_kvoffload.transfer import (
    CanonicalPoolView,
    GroupCaches,
    GroupTransfer,
    HostChunkPool,
    TransferEngine,
    layer_view,
    plans_for_rank,
)

# form -> (layout, axes of one array: "b" block, "t" token, "h" head, "2" K/V, "e" elems)
FORMS = {
    "packed-nhd": (pk.KVLayout.nhd(), "bthe"),
    "packed-hnd": (pk.KVLayout.hnd(), "bhte"),
    "split-nhd": (pk.KVLayout.nhd(pk.KVStacking.SECOND), "b2the"),
    "split-hnd": (pk.KVLayout.hnd(pk.KVStacking.SECOND), "b2hte"),
    "first-nhd": (pk.KVLayout.nhd(pk.KVStacking.FIRST), "2bthe"),
    "separate-hnd": (pk.KVLayout.hnd(pk.KVStacking.SEPARATE), "bhte"),
    "mla": (pk.KVLayout.mla(), "bte"),
}
LAYERS = ("l0", "l1")


@dataclass(frozen=True)
class Topology:
    tp: int = 1
    dcp: int = 1
    pcp: int = 1
    interleave: int = 1

    @property
    def cp(self) -> int:
        return self.dcp * self.pcp


@dataclass(frozen=True)
class Model:
    form: str
    total_heads: int = 4
    head_size: int = 8  # per K (or V); MLA: the latent width
    block_size: int = 4  # tokens per block on one rank
    dtype: str = "bfloat16"
    num_blocks: int = 6


def _shape(model: Model, heads: int, tokens: int) -> tuple[int, ...]:
    _, axes = FORMS[model.form]
    packed = model.form.startswith("packed")
    size = {
        "b": model.num_blocks,
        "t": tokens,
        "h": heads,
        "2": 2,
        "e": model.head_size * (2 if packed else 1),
    }
    return tuple(size[a] for a in axes)


def reference(model: Model, topo: Topology, seed: int = 0) -> list[np.ndarray]:
    """The single-device cache (every head, block_size * cp tokens), as numpy arrays."""
    heads = 1 if model.form == "mla" else model.total_heads
    shape = _shape(model, heads, model.block_size * topo.cp)
    n = 2 * len(LAYERS) if model.form.startswith("separate") else len(LAYERS)
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**16, size=(n, *shape), dtype=np.uint16)
    return [b.view(jnp.bfloat16) for b in bits] if model.dtype == "bfloat16" else list(bits)


def shard(model: Model, arrays: list[np.ndarray], ctx: RankContext) -> list[np.ndarray]:
    """A rank's local cache: its head shard and its tokens (CP interleaving)."""
    _, axes = FORMS[model.form]
    tokens = [ctx.canonical_token(i) for i in range(model.block_size)]
    out = []
    for a in arrays:
        a = np.take(a, tokens, axis=axes.index("t"))
        if "h" in axes:
            h, tp = model.total_heads, ctx.tp_size
            local = max(1, h // tp)
            first = (ctx.tp_rank // (tp // h)) if h < tp else ctx.tp_rank * local
            a = np.take(a, range(first, first + local), axis=axes.index("h"))
        out.append(np.ascontiguousarray(a))
    return out


def spec_for(model: Model, topo: Topology):
    if model.form == "mla":
        return MLAAttentionSpec(
            block_size=model.block_size, head_size=model.head_size, dtype=model.dtype
        )
    return FullAttentionSpec(
        block_size=model.block_size,
        num_kv_heads=max(1, model.total_heads // topo.tp),
        head_size=model.head_size,
        dtype=model.dtype,
    )


def register(model: Model, topo: Topology) -> tuple[CanonicalRegistration, tuple[RankContext, ...]]:
    engine = EngineConfig(
        model_config=ModelConfig(
            model="m",
            dtype=model.dtype,
            total_num_kv_heads=model.total_heads,
            use_mla=model.form == "mla",
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=topo.tp,
            decode_context_parallel_size=topo.dcp,
            prefill_context_parallel_size=topo.pcp,
            cp_kv_cache_interleave_size=topo.interleave,
        ),
    )
    kv = KVCacheConfig(
        num_blocks=model.num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=(
            KVCacheGroupSpec(layer_names=LAYERS, kv_cache_spec=spec_for(model, topo)),
        ),
    )
    layout, _ = FORMS[model.form]
    local = shard(model, reference(model, topo), rank_contexts(engine)[0])
    views = {name: layer_view(layout, local[0].shape, local[0].dtype) for name in LAYERS}
    layers = derive_layer_mappings(engine, kv, views)
    for name in LAYERS:
        if not layers[name].certified:
            raise AssertionError(f"{model} {topo}: {layers[name].refusal}")
    reg = CanonicalRegistration(layers=layers, rank=0, all_layers_portable=True)
    return reg, rank_contexts(engine)


def _engine(model, arrays, reg, rank, shared):
    layout, _ = FORMS[model.form]
    caches = {0: GroupCaches([jnp.asarray(a) for a in arrays], layout)}
    view = CanonicalPoolView(shared, plans_for_rank(reg, {0: LAYERS}, caches, rank))
    return TransferEngine(caches, view, backend="xla", max_bucket=4), view


def store(model: Model, topo: Topology, ref: list[np.ndarray], blocks, chunks, bpc=2):
    """Every rank stores `blocks` of its shard into one shared canonical pool."""
    reg, contexts = register(model, topo)
    width = sum(reg.layers[n].mappings[0].canonical_page_size_bytes for n in LAYERS)
    shared = HostChunkPool(max(chunks) + 1, {0: width}, bpc)
    written = 0
    for ctx in contexts:
        eng, view = _engine(model, shard(model, ref, ctx), reg, ctx.rank, shared)
        with eng:
            eng.submit_store(1, [GroupTransfer(0, tuple(blocks), tuple(chunks))])
            (result,) = eng.wait([1])
            assert result.success, result.error
        written += view.bytes_written
    return shared, written


def load(model: Model, topo: Topology, shared: HostChunkPool, blocks, chunks):
    """Every rank loads `blocks` from the shared pool into zeroed caches; their arrays."""
    reg, contexts = register(model, topo)
    zeros = [np.zeros_like(a) for a in reference(model, topo)]
    out = []
    for ctx in contexts:
        local = [np.zeros_like(a) for a in shard(model, zeros, ctx)]
        eng, _ = _engine(model, local, reg, ctx.rank, shared)
        with eng:
            eng.submit_load(2, [GroupTransfer(0, tuple(blocks), tuple(chunks))])
            (result,) = eng.wait([2])
            assert result.success, result.error
            out.append([np.asarray(a) for a in eng.arrays(0)])
    return contexts, out
