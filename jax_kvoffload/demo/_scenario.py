"""The prefix-reuse scenario: A is offloaded, its blocks are reused, B loads A's prefix.

1. warm-up: compile the model steps and both transfer directions (not timed below);
2. request A (`prompt_blocks` full blocks + a short tail) is prefilled and decoded, and
   its full blocks are stored to host memory through the `KVOffloader`;
3. A finishes: its blocks go back to the free list, and filler request C is prefilled
   into exactly those blocks, overwriting A's K/V;
4. request B = A's prefix + a new suffix: lookup, load the hit into fresh blocks,
   prefill only the remainder, decode;
5. request R = B recomputed from scratch in other blocks; B's logits at every suffix
   position and its decoded tokens must equal R's exactly.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import jax
import numpy as np

from jax_kvoffload.demo._config import ScenarioConfig, tier_entry
from jax_kvoffload.demo._model import DemoTransformer
from jax_kvoffload.demo._serving import (
    CACHE_LAYOUTS,
    PagedServer,
    Progress,
    Request,
    block_hashes,
    empty_caches,
)
from jax_kvoffload.demo._verdict import TierLog, tier_verdict
from jax_kvoffload.transfer import GroupCaches


def build_offloader(cfg: ScenarioConfig, num_blocks: int, mesh_size: int | None = None):
    """The `OffloadingConfig` of the demo engine and a `KVOffloader` over fresh caches.

    With `mesh_size`, the caches are global arrays sharded over that many devices (the
    engine at TP=`mesh_size`) and the offloader stores canonical pages, which an engine
    on a mesh of another size loads (`_mesh.py`)."""
    from jax_kvoffload import KVOffloader
    from jax_kvoffload.config import (
        CacheConfig,
        EngineConfig,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        build_offloading_config,
    )

    m = cfg.model
    tp = mesh_size or 1
    if mesh_size is None:
        caches = empty_caches(
            m.num_layers, num_blocks, cfg.block_size, m.num_kv_heads, m.head_dim, m.cache_layout
        )
    else:  # --mesh-sizes: NHD caches sharded over KV heads (the CLI refuses it with rpa)
        from jax_kvoffload.demo._mesh import mesh_caches

        caches = mesh_caches(
            tp, m.num_layers, num_blocks, cfg.block_size, m.num_kv_heads, m.head_dim
        )
    group = GroupCaches(caches, CACHE_LAYOUTS[m.cache_layout])
    # Room for the warm-up's chunks and A's, twice over: nothing is evicted in the demo.
    budget = 4 * (cfg.prompt_blocks + cfg.blocks_per_chunk) * group.block_bytes
    spec = FullAttentionSpec(  # vLLM's convention: one TP rank's KV heads
        block_size=cfg.block_size, num_kv_heads=max(1, m.num_kv_heads // tp),
        head_size=m.head_dim,
        dtype="float32",  # type: ignore[arg-type]  # a name: as_dtype
    )  # fmt: skip
    engine = EngineConfig(
        model_config=ModelConfig(
            model="jax-kvoffload-demo",
            dtype="float32",  # type: ignore[arg-type]  # a name: as_dtype
            total_num_kv_heads=m.num_kv_heads,
        ),
        cache_config=CacheConfig(block_size=cfg.block_size),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=KVTransferConfig(
            kv_connector_extra_config={
                "cpu_bytes_to_use": budget,
                "blocks_per_chunk": cfg.blocks_per_chunk,
                **({"canonical_layout": True} if mesh_size is not None else {}),
                **({"secondary_tiers": [tier_entry(t) for t in cfg.tiers]} if cfg.tiers else {}),
            },
            engine_id="demo",
        ),
    )
    layers = tuple(f"layers.{i}" for i in range(m.num_layers))
    kv = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=(),
        kv_cache_groups=(KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec),),
    )
    config = build_offloading_config(engine, kv)
    # The model's heads: canonical pages need them, and they make the RPA check exact
    # (a padded RPA array's bytes do not state its heads).
    rpa = m.cache_layout == "rpa"
    heads = {} if mesh_size is None and not rpa else {"total_kv_heads": m.num_kv_heads}
    return KVOffloader(config, group, backend=cfg.kernel_backend, **heads)


def _rate(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _block_words(off, block_ids) -> np.ndarray:
    ids = np.asarray(block_ids)
    return np.stack([np.asarray(a)[ids] for a in off.caches()])


def run_scenario(cfg: ScenarioConfig, progress: Progress | None = None) -> dict:
    """Runs the scenario; returns the JSON-ready summary: `summary["passed"]` (the logits
    check, `summary["check"]["passed"]`, and every tier's, `summary["tiers"][i]["check"]`)."""
    wall = time.perf_counter()
    report = progress or (lambda *_: None)
    with TierLog() as log:  # the tiers' warnings: why a tier took nothing
        summary = _run(cfg, report, progress, log)
    summary["wall_s"] = time.perf_counter() - wall
    return summary


def _run(cfg: ScenarioConfig, report: Progress, progress: Progress | None, log: TierLog) -> dict:
    rng = np.random.default_rng(cfg.model.seed + 1)
    vocab, bs = cfg.model.vocab_size, cfg.block_size

    def tokens(n: int) -> list[int]:
        return rng.integers(0, vocab, n).tolist()

    report("build model", 0, 1)
    model = DemoTransformer(cfg.model)
    per_seq = cfg.max_blocks_per_seq
    # C holds A's old blocks while B and R run: three sequences at once, plus slack.
    off = build_offloader(cfg, num_blocks=3 * per_seq + cfg.blocks_per_chunk)
    server = PagedServer(model, off, block_size=bs, max_blocks_per_seq=per_seq)
    block_bytes = GroupCaches(off.caches(), CACHE_LAYOUTS[cfg.model.cache_layout]).block_bytes
    report("build model", 1, 1)
    try:
        # 1. warm-up: one round trip of the same block count, then forget it.
        start = time.perf_counter()
        warm = Request("warm-up", tokens(cfg.prompt_blocks * bs + cfg.tail_tokens))
        server.decode(warm, min(1, cfg.decode_tokens), server.prefill(warm, progress)[-1])
        warm_hashes = block_hashes(warm.tokens, bs, seed=b"warm-up")[: cfg.prompt_blocks]
        _finish(off, off.store(warm_hashes, warm.block_ids[: cfg.prompt_blocks]), "warm-up store")
        n = off.lookup(warm_hashes)
        _finish(off, off.load(warm_hashes[:n], warm.block_ids[:n]), "warm-up load")
        jax.block_until_ready(off.caches())
        server.free(warm)
        off.reset_cache()
        warmup_s = time.perf_counter() - start
        after_warmup = off.stats()  # the summary's stats count from here

        # 2. request A: prefill, decode, store its full prompt blocks.
        prefix = tokens(cfg.prompt_blocks * bs)
        a = Request("A", prefix + tokens(cfg.tail_tokens))
        server.decode(a, cfg.decode_tokens, server.prefill(a, progress)[-1])
        a_hashes = block_hashes(a.tokens, bs)[: cfg.prompt_blocks]
        a_blocks = list(a.block_ids[: cfg.prompt_blocks])
        a_words = _block_words(off, a_blocks)
        # Waited for here so the store's time is the transfer's alone; an engine would
        # go on computing (C's prefill below may donate the arrays the gather reads).
        stored = _finish(off, off.store(a_hashes, a_blocks), "A's store")

        # 3. A finishes; C reuses its blocks.
        server.free(a)
        c = Request("C", tokens(len(a.tokens)))
        server.prefill(c, progress)
        reused = set(a_blocks) <= set(c.block_ids)
        overwritten = not np.array_equal(a_words, _block_words(off, a_blocks))

        # 4. request B: lookup, load the hit into fresh blocks, prefill the rest.
        b = Request("B", prefix + tokens(cfg.suffix_tokens))
        b_hashes = block_hashes(b.tokens, bs)
        start = time.perf_counter()
        hit = off.lookup(b_hashes)
        server.reserve(b, len(b.tokens))
        loaded = None
        if hit and not cfg.skip_load:
            loaded = _finish(off, off.load(b_hashes[:hit], b.block_ids[:hit]), "B's load")
            jax.block_until_ready(off.caches())
        load_s = time.perf_counter() - start
        b.num_computed = hit * bs
        b_logits = server.prefill(b, progress)
        hit_s = time.perf_counter() - start
        b_tokens, b_decode = server.decode(b, cfg.decode_tokens, b_logits[-1])

        # 5. request R: B from scratch, in other blocks.
        r = Request("R", list(b.tokens[: len(prefix) + cfg.suffix_tokens]))
        start = time.perf_counter()
        r_logits = server.prefill(r, progress)
        full_s = time.perf_counter() - start
        r_tokens, r_decode = server.decode(r, cfg.decode_tokens, r_logits[-1])
        r_suffix = r_logits[hit * bs :]
        disjoint = not set(b.block_ids) & set(r.block_ids)
        for request in (b, r, c):
            server.free(request)
        host = {"chunks": off.num_chunks, "bytes": off.host_bytes}
        stats = off.stats().since(after_warmup)
    finally:
        off.close()
    tiers = [asdict(t) for t in off.tier_stats]  # after close: every cascade counted

    logits_equal = bool(np.array_equal(b_logits, r_suffix))
    decode_equal = b_tokens == r_tokens and bool(np.array_equal(b_decode, r_decode))
    stored_ok = stored.success and (loaded is None or loaded.success)
    # The check shows a reuse only if B hit A's whole prefix, the bytes came from the
    # host (A's blocks were overwritten meanwhile) and R computed in other blocks.
    failures = [
        why
        for good, why in (
            (stored_ok, "a store or load job failed"),
            (hit == cfg.offloaded_blocks, f"B hit {hit} of the {cfg.offloaded_blocks} blocks"),
            (reused and overwritten, "C did not overwrite A's blocks: a load is not shown"),
            (disjoint, "R computed in B's blocks"),
            (logits_equal, "B's logits differ from a full recompute"),
            (decode_equal, "B decoded other tokens than R"),
        )
        if not good
    ]
    passed = not failures
    tiers = [
        dict(t, spec=spec, check=tier_verdict(spec, t, cfg.offloaded_chunks, log))
        for t, spec in zip(tiers, cfg.tiers, strict=True)
    ]
    return {
        "passed": bool(passed and all(t["check"]["passed"] for t in tiers)),
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "model": asdict(cfg.model),
        "scenario": {k: v for k, v in asdict(cfg).items() if k != "model"},
        "block_bytes": block_bytes,
        "host": host,
        "tiers": tiers,  # each with its "check": {"passed", "why"}
        "requests": {
            "A_tokens": len(prefix) + cfg.tail_tokens,
            "B_tokens": len(prefix) + cfg.suffix_tokens,
            "shared_prefix_tokens": len(prefix),
        },
        "filler_reused_A_blocks": reused,
        "A_blocks_overwritten": overwritten,
        "prefix_hit_tokens": hit * bs,
        "prefix_hit_blocks": hit,
        "store": _transfer(stored, block_bytes),
        "stats": stats.as_dict(),  # OffloadStats since the warm-up (docs/observability.md)
        "load": _transfer(loaded, block_bytes),
        "prefill": {
            "warmup_s": warmup_s,
            "with_hit_s": hit_s,
            "with_hit_load_s": load_s,
            "with_hit_tokens_computed": len(b_logits),
            "full_recompute_s": full_s,
            "full_recompute_tokens_computed": len(r_logits),
            "speedup": full_s / hit_s if hit_s > 0 else 0.0,
        },
        "check": {
            "positions_compared": len(b_logits),
            "logits_equal": logits_equal,
            "max_abs_diff": float(np.max(np.abs(b_logits - r_suffix))),
            "decoded_tokens": b_tokens,
            "decode_equal": decode_equal,
            "recompute_in_disjoint_blocks": disjoint,
            "passed": passed,
            "why": "; ".join(failures) or None,
        },
    }


def _finish(off, job: int | None, what: str):
    """Waits for one job; a store the host refused (no room) is an error in the demo."""
    if job is None:
        raise RuntimeError(f"{what}: the offloader started no job (host store full?)")
    (result,) = off.wait([job])
    return result


def _transfer(result, block_bytes: int) -> dict:
    if result is None:
        return {"blocks": 0, "bytes": 0, "seconds": 0.0, "gb_per_s": 0.0, "success": None}
    return {
        "blocks": result.size_bytes // block_bytes,
        "bytes": result.size_bytes,
        "seconds": result.seconds,
        "gb_per_s": _rate(result.size_bytes, result.seconds),
        "success": result.success,
    }
