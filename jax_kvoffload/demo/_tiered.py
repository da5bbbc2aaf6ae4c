"""Two engine processes in turn over a secondary tier: the second serves the first's prefix.

`jax-kvoffload demo --tier T --two-process` runs, for each tier T given (the parent,
which never imports jax, is `_two_process.py`; these are the two roles):

1. **writer** (a fresh process): prefills request A (`prompt_blocks` full blocks plus a
   tail), stores its full blocks through the `KVOffloader`, whose host store cascades
   them into the tier; `flush_tiers()` and `close()` before it exits.
2. **reader** (another fresh process: empty host memory, its own device caches): after
   a warm-up that compiles every step, request B = A's prefix + a new suffix.
   `lookup` finds the prefix in the tier and promotes it into host chunks, `load`
   copies it into B's blocks, B prefills only the suffix. R recomputes B from scratch;
   B's logits and decoded tokens must equal R's exactly.

The reader times serving the prefix from the tier (lookup + promotion + load, until the
blocks are on the device) against recomputing it (R's prefill of the same blocks), and
the parent prints the ratio per tier. Both roles draw the shared prefix from the same
seeded generator, so they agree on the tokens without talking to each other.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import jax
import numpy as np

from jax_kvoffload.demo._config import ScenarioConfig
from jax_kvoffload.demo._mesh import role_mesh_size
from jax_kvoffload.demo._model import DemoTransformer
from jax_kvoffload.demo._scenario import build_offloader
from jax_kvoffload.demo._serving import PagedServer, Progress, Request, block_hashes
from jax_kvoffload.demo._verdict import TierLog, reader_verdict, tier_verdict

__all__ = ["run_reader", "run_writer"]

FLUSH_TIMEOUT_S = 600  # the writer's wait for its cascade


def _prefix(cfg: ScenarioConfig) -> list[int]:
    rng = np.random.default_rng([cfg.model.seed, 2])  # the same in both processes
    return rng.integers(0, cfg.model.vocab_size, cfg.prompt_blocks * cfg.block_size).tolist()


def _tokens(cfg: ScenarioConfig, stream: int, n: int) -> list[int]:
    rng = np.random.default_rng([cfg.model.seed, stream])
    return rng.integers(0, cfg.model.vocab_size, n).tolist()


def _engine(cfg: ScenarioConfig, progress: Progress | None, role: str):
    report = progress or (lambda *_: None)
    report("build engine", 0, 1)
    model = DemoTransformer(cfg.model)
    per_seq = cfg.max_blocks_per_seq
    mesh = role_mesh_size(cfg, role)
    off = build_offloader(cfg, num_blocks=3 * per_seq + cfg.blocks_per_chunk, mesh_size=mesh)
    server = PagedServer(model, off, block_size=cfg.block_size, max_blocks_per_seq=per_seq)
    report("build engine", 1, 1)
    return off, server


def _mesh_check(cfg: ScenarioConfig, role: str, devices: int) -> list[str]:
    """Why the role's caches are not on the mesh asked for (empty when they are)."""
    want = role_mesh_size(cfg, role) or 1
    if devices == want:
        return []
    return [f"the {role}'s caches are on {devices} devices, not the {want} asked for"]


def run_writer(cfg: ScenarioConfig, progress: Progress | None = None) -> dict:
    """The first process: A's prefix into the host store and, by cascade, the tier."""
    with TierLog() as log:
        off, server = _engine(cfg, progress, "writer")
        devices = len(off.caches()[0].sharding.device_set)
        bs = cfg.block_size
        try:
            a = Request("A", _prefix(cfg) + _tokens(cfg, 3, cfg.tail_tokens))
            start = time.perf_counter()
            server.prefill(a, progress)
            prefill_s = time.perf_counter() - start
            hashes = block_hashes(a.tokens, bs)[: cfg.prompt_blocks]
            job = off.store(hashes, a.block_ids[: cfg.prompt_blocks])
            (stored,) = off.wait([job]) if job is not None else (None,)
            flushed = off.flush_tiers(timeout=FLUSH_TIMEOUT_S)
        finally:
            off.close()
        stats = [asdict(t) for t in off.tier_stats]
        pairs = zip(cfg.tiers, stats, strict=True)
        checks = [tier_verdict(s, t, cfg.offloaded_chunks, log) for s, t in pairs]
    stored_ok = stored is not None and stored.success
    why = [c["why"] for c in checks if not c["passed"]]
    why += _mesh_check(cfg, "writer", devices)
    if not stored_ok:
        why.insert(0, "A's store into the host tier failed")
    if not flushed:
        why.append(f"the cascade did not finish within {FLUSH_TIMEOUT_S} s")
    return {
        "role": "writer",
        "backend": jax.default_backend(),
        "mesh_size": devices,
        "prefill_s": prefill_s,
        "stored_blocks": cfg.offloaded_blocks if stored_ok else 0,
        "flushed": flushed,
        "tiers": stats,
        "passed": not why,
        "error": "; ".join(why) or None,
    }


def run_reader(cfg: ScenarioConfig, progress: Progress | None = None) -> dict:
    """The second process: B's prefix from the tier, checked against a recompute."""
    off, server = _engine(cfg, progress, "reader")
    devices = len(off.caches()[0].sharding.device_set)
    bs = cfg.block_size
    try:
        # Warm-up: compile the steps and both transfer directions (nothing timed).
        warm = Request("warm-up", _tokens(cfg, 4, cfg.prompt_blocks * bs + cfg.tail_tokens))
        server.decode(warm, min(1, cfg.decode_tokens), server.prefill(warm, progress)[-1])
        warm_hashes = block_hashes(warm.tokens, bs, seed=b"warm-up")[: cfg.prompt_blocks]
        off.wait([off.store(warm_hashes, warm.block_ids[: cfg.prompt_blocks])])
        n = off.lookup(warm_hashes)
        off.wait([off.load(warm_hashes[:n], warm.block_ids[:n])])
        jax.block_until_ready(off.caches())
        server.free(warm)
        off.reset_cache()  # the host forgets; the tier keeps A's prefix

        prefix = _prefix(cfg)
        b = Request("B", prefix + _tokens(cfg, 5, cfg.suffix_tokens))
        b_hashes = block_hashes(b.tokens, bs)
        start = time.perf_counter()
        hit = off.lookup(b_hashes)  # blocks: the tier's chunks, promoted into the host
        server.reserve(b, len(b.tokens))
        loaded = None
        if hit and not cfg.skip_load:  # skip_load: the negative control, must fail
            (loaded,) = off.wait([off.load(b_hashes[:hit], b.block_ids[:hit])])
            jax.block_until_ready(off.caches())
        serve_s = time.perf_counter() - start
        b.num_computed = hit * bs
        b_logits = server.prefill(b, progress)
        b_tokens, b_decode = server.decode(b, cfg.decode_tokens, b_logits[-1])

        # R: the same prefix recomputed (timed alone), then the suffix.
        r = Request("R", list(prefix[: hit * bs]))
        start = time.perf_counter()
        server.prefill(r, progress)
        jax.block_until_ready(off.caches())
        recompute_s = time.perf_counter() - start
        r.tokens += b.tokens[hit * bs : len(prefix) + cfg.suffix_tokens]
        r_logits = server.prefill(r, progress)
        r_tokens, r_decode = server.decode(r, cfg.decode_tokens, r_logits[-1])
    finally:
        off.close()
    logits_equal = bool(np.array_equal(b_logits, r_logits))
    decode_equal = b_tokens == r_tokens and bool(np.array_equal(b_decode, r_decode))
    loaded_ok = loaded is not None and loaded.success
    tiers = [asdict(t) for t in off.tier_stats]
    served = [
        reader_verdict(spec, t, hit, cfg.offloaded_blocks, cfg.offloaded_chunks)
        for spec, t in zip(cfg.tiers, tiers, strict=True)
    ]
    why = [c["why"] for c in served if not c["passed"]]
    why += _mesh_check(cfg, "reader", devices)
    for good, text in (
        (loaded_ok or not hit or cfg.skip_load, "the load of B's prefix failed"),
        (logits_equal, "B's logits differ from a full recompute"),
        (decode_equal, "B decoded other tokens than R"),
    ):
        if not good:
            why.append(text)
    return {
        "role": "reader",
        "backend": jax.default_backend(),
        "mesh_size": devices,
        "prefix_hit_blocks": hit,
        "prefix_hit_tokens": hit * bs,
        "serve_prefix_s": serve_s,
        "recompute_prefix_s": recompute_s,
        "ratio": recompute_s / serve_s if serve_s > 0 else 0.0,
        "positions_compared": len(b_logits),
        "logits_equal": logits_equal,
        "max_abs_diff": float(np.max(np.abs(b_logits - r_logits))) if len(b_logits) else 0.0,
        "decode_equal": decode_equal,
        "tiers": tiers,
        "passed": not why,
        "error": "; ".join(why) or None,
    }
