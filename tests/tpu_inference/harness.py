"""Drives a tpu-inference offload connector on a CPU mesh; one JSON result per scenario.

    python -m tests.tpu_inference.harness --out results.json \\
        [--connector tpu_inference.offload.tpu_offload_connector:TPUOffloadConnector] \\
        [--extra-config '{...}'] [--only NAME ...]

The connector under test is a parameter: tpu-inference 0.32.0's `TPUOffloadConnector`
with its `LocalCPUBackend` (the baseline), or ours (`jax_kvoffload.bridge.tpu_inference:
TPUOffloadConnector`, with `secondary_tiers` in --extra-config for the tier scenarios).
It is driven only through what tpu-inference's runner and vLLM call
(the `KVConnectorBase_V1` methods plus `register_runner`) and fed tpu-inference's own
metadata types (`TPUOffloadConnectorMetadata`, `TPUReqMeta`, `SaveSpec`, `LoadSpec`), as
their offload tests drive it: a mock runner, a CPU mesh, their cache shapes.

Scenarios (`SCENARIOS`):
  roundtrip/<mesh>/<dtype>/<pattern>
                            worker only: save blocks of two requests into chunks, give the
                            runner new caches (other bits), load the chunks into other
                            blocks; every loaded block holds the saved bits in every
                            layer, every other block keeps its bits, the stats report
                            each chunk once as [chunk, process index]. Patterns: "values"
                            (finite normal numbers, as their tests use), "bits" (every
                            bit pattern: NaN payloads, -0.0, subnormals).
  bucketed/attn_dp/bfloat16/values   with their bucketed, pre-compiled swap ops.
  hybrid/attn_dp/bfloat16/values     two layer groups of different head counts.
  shapes                    their kv-cache shape function against the RPA v3 formula.
  engine/prefix_hit         scheduler and worker: a prompt is saved, a second prompt with
                            the same prefix is told the hit and loads exactly it.
  engine/full_hit           the identical prompt: N blocks hit, N*block_size - 1 tokens
                            reported (their rule), N blocks loaded.
  engine/events             with KV events on: the events the scheduler-role connector
                            yields after a prompt was saved (reported, judged by the
                            caller: vLLM's default connector surface yields none).
  engine/restart            fresh connectors (a restarted engine: a new config object)
                            asked for that prompt: the hit count is reported, not judged
                            (host memory dies with the engine: 0 for both without tiers).

Tier scenarios (`TIER_SCENARIOS`, ours only, with `secondary_tiers` in --extra-config;
each in its own process, run by the caller one after the other):
  tier/save                 an engine saves the prompt and waits until its tiers hold it.
  tier/serve                a fresh process's engine is asked for the prompt: every full
                            block is reported, loaded from the tier with the right bytes.

Each result: {"ok": bool, "error": str | None, "facts": {...}}. Exit status 0 whenever
the results were written (the caller judges them), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
import traceback

import numpy as np

THEIRS = "tpu_inference.offload.tpu_offload_connector:TPUOffloadConnector"
DTYPE_NAMES = ("bfloat16", "float8_e4m3fn", "int8", "float32")
SCENARIOS = (
    *(f"roundtrip/attn_dp/{d}/{p}" for p in ("values", "bits") for d in DTYPE_NAMES),
    "roundtrip/model/bfloat16/values",
    "bucketed/attn_dp/bfloat16/values",
    "hybrid/attn_dp/bfloat16/values",
    "shapes",
    "engine/prefix_hit",
    "engine/full_hit",
    "engine/restart",
    "engine/events",
)
TIER_SCENARIOS = ("tier/save", "tier/serve")
# Cache geometry: small enough for 2 CPU cores, every axis of the RPA layout present.
LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 24, 16, 4, 128
DEVICES = 4


class ScenarioFailed(AssertionError):
    """A check of a scenario did not hold (the message says which and what was seen)."""


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise ScenarioFailed(message)


# -- worker scenarios -------------------------------------------------------------------


def _worker(ctx, mesh_kind: str, dtype_name: str, pattern: str, shapes=None):
    s = ctx["stack"]
    m, spec = s.mesh(mesh_kind)
    dtype = s.DTYPES[dtype_name]
    if shapes is None:
        shape = s.cache_shape(m, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype)
        shapes = [shape] * LAYERS
    connector = ctx["cls"](ctx["config"], ctx["roles"].WORKER)
    caches, before = s.make_caches(m, spec, shapes, dtype, 1, pattern)
    runner = s.Runner(caches, m)
    connector.register_runner(runner)
    return connector, runner, m, spec, dtype, shapes, before


def _meta(ctx, req_id, local_ids, save=None, load=None):
    t = ctx["types"]
    return t.TPUReqMeta(
        req_id=req_id,
        token_ids=list(range(len(local_ids) * BLOCK_SIZE)),
        local_block_ids=list(local_ids),
        save_spec=save,
        load_spec=load,
    )


def _save(t, skip_blocks, total_blocks, src, chunks):
    return t.SaveSpec(
        num_skip_leading_tokens=skip_blocks * BLOCK_SIZE,
        num_total_tokens=total_blocks * BLOCK_SIZE,
        src_blocks=list(src),
        dst_chunks=list(chunks),
    )


def _load(t, skip_blocks, matched_blocks, chunks, dst):
    return t.LoadSpec(
        num_matched_tokens=matched_blocks * BLOCK_SIZE,
        src_chunks=list(chunks),
        dst_blocks=list(dst),
        can_load=True,
        num_skip_leading_tokens=skip_blocks * BLOCK_SIZE,
    )


def _drain_saves(connector, expected: dict[str, list[int]]) -> dict[str, list]:
    """Polls the worker's stats until every expected chunk save was reported."""
    seen: dict[str, list] = {}
    deadline = time.monotonic() + 120
    while sum(len(v) for v in seen.values()) < sum(len(v) for v in expected.values()):
        stats = connector.get_kv_connector_stats()
        if stats is not None:
            for req, chunks in stats.data["finished_save_chunks"].items():
                seen.setdefault(req, []).extend(chunks)
        _expect(time.monotonic() < deadline, f"saves not reported in 120 s: {seen}")
        time.sleep(0.01)
    return seen


def roundtrip(ctx, mesh_kind: str, dtype_name: str, pattern: str, shapes=None) -> dict:
    s, t = ctx["stack"], ctx["types"]
    connector, runner, m, spec, dtype, shapes, before = _worker(
        ctx, mesh_kind, dtype_name, pattern, shapes
    )
    rng = np.random.default_rng(3)
    order = [int(b) for b in rng.permutation(NUM_BLOCKS)]
    # Request a saves 5 of its 7 blocks, b 3 of its 4 (their worker saves a contiguous
    # run of the request's own block list); chunks come in a scrambled order.
    a_local, b_local = order[:7], order[7:11]
    a_src, b_src = a_local[1:6], b_local[1:4]
    chunks = [int(c) for c in rng.permutation(32)[:8]]
    a_chunks, b_chunks = chunks[:5], chunks[5:]
    saves = [
        _meta(ctx, "a", a_local, save=_save(t, 1, 6, a_src, a_chunks)),
        _meta(ctx, "b", b_local, save=_save(t, 1, 4, b_src, b_chunks)),
    ]
    connector.bind_connector_metadata(t.TPUOffloadConnectorMetadata(requests_meta=saves))
    connector.start_load_kv(None)
    connector.wait_for_save()
    reported = _drain_saves(connector, {"a": a_chunks, "b": b_chunks})
    connector.clear_connector_metadata()
    _expect(
        reported == {"a": [[c, 0] for c in a_chunks], "b": [[c, 0] for c in b_chunks]},
        f"finished_save_chunks {reported}",
    )
    # The engine writes on: the runner's caches now hold other bits everywhere.
    fresh, after = s.make_caches(m, spec, shapes, dtype, 2, pattern)
    runner.kv_caches = fresh
    # Load a's chunks into request c's blocks 0..4; b's into d's blocks 2..4 after two
    # blocks vLLM already computed (num_skip_leading_tokens).
    free = order[11:]
    c_local, d_local = free[:5], free[5:10]
    c_dst, d_dst = c_local, d_local[2:5]
    loads = [
        _meta(ctx, "c", c_local, load=_load(t, 0, 5, a_chunks, c_dst)),
        _meta(ctx, "d", d_local, load=_load(t, 2, 5, b_chunks, d_dst)),
    ]
    connector.bind_connector_metadata(t.TPUOffloadConnectorMetadata(requests_meta=loads))
    connector.start_load_kv(None)
    connector.wait_for_save()
    stats = connector.get_kv_connector_stats()
    connector.clear_connector_metadata()
    got = [s.bits(c) for c in runner.kv_caches]
    moved = dict(zip(c_dst + d_dst, a_src + b_src, strict=True))
    wrong, clobbered = [], []
    for layer in range(len(shapes)):
        for block in range(NUM_BLOCKS):
            if block in moved:
                if not (got[layer][block] == before[layer][moved[block]]).all():
                    wrong.append((layer, block))
            elif not (got[layer][block] == after[layer][block]).all():
                clobbered.append((layer, block))
    _expect(not wrong, f"loaded blocks (layer, block) without the saved bits: {wrong}")
    _expect(not clobbered, f"blocks not loaded whose bits changed (layer, block): {clobbered}")
    loaded = {} if stats is None else stats.data["finished_load_chunks"]
    _expect(
        loaded == {"c": [[c, 0] for c in a_chunks], "d": [[c, 0] for c in b_chunks]},
        f"finished_load_chunks {loaded}",
    )
    return {"cache_shape": list(shapes[0]), "mesh": dict(m.shape), "spec": str(spec)}


def bucketed(ctx) -> dict:
    os.environ["TPU_OFFLOAD_SKIP_JAX_PRECOMPILE"] = "0"  # read when a worker is built
    try:
        return roundtrip(ctx, "attn_dp", "bfloat16", "values")
    finally:
        os.environ["TPU_OFFLOAD_SKIP_JAX_PRECOMPILE"] = "1"


def hybrid(ctx) -> dict:
    s = ctx["stack"]
    m, _ = s.mesh("attn_dp")
    wide = s.cache_shape(m, NUM_BLOCKS, BLOCK_SIZE, 2 * KV_HEADS, HEAD_DIM, s.DTYPES["bfloat16"])
    narrow = s.cache_shape(m, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, s.DTYPES["bfloat16"])
    return roundtrip(ctx, "attn_dp", "bfloat16", "values", [wide, wide, narrow, narrow])


def shapes(ctx) -> dict:
    s = ctx["stack"]
    theirs = s.their_shape_function()
    if theirs is None:
        return {"skipped": "tpu_inference.runner.kv_cache does not import (torchax missing)"}
    m, _ = s.mesh("model")
    seen = {}
    for name, dtype in s.DTYPES.items():
        for heads, dim in ((4, 128), (8, 96), (4, 64), (12, 256)):
            got = tuple(theirs(m, 10, BLOCK_SIZE, heads, dim, dtype))
            want = s.rpa_formula(10, BLOCK_SIZE, heads, dim, dtype, m.shape["model"])
            _expect(got == want, f"{name} heads={heads} dim={dim}: theirs {got}, formula {want}")
            seen[f"{name}/{heads}x{dim}"] = list(got)
    return seen


# -- scheduler + worker -----------------------------------------------------------------


def _engine(ctx, events: bool = False):
    s = ctx["stack"]
    m, spec = s.mesh("attn_dp")
    dtype = s.DTYPES["bfloat16"]
    shape = s.cache_shape(m, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype)
    config = ctx["new_config"]()  # one engine, one config (vLLM's: a fresh VllmConfig)
    if events:
        from vllm.config import KVEventsConfig

        config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True)
    return ctx["engine"].MiniEngine(ctx["cls"], config, m, spec, shape, dtype, LAYERS)


PROMPT = list(range(1000, 1000 + 3 * BLOCK_SIZE + 5))  # 3 full blocks and a partial one


def prefix_hit(ctx) -> dict:
    engine = _engine(ctx)
    first = engine.prefill(engine.new_request("p1", PROMPT))
    engine.finish(engine.requests["p1"])
    _expect(first.matched_tokens == 0, f"an empty cache reported {first.matched_tokens} tokens")
    _expect(first.saved_chunks == 3, f"3 full blocks to save, {first.saved_chunks} reported")
    second = engine.prefill(engine.new_request("p2", PROMPT[: 3 * BLOCK_SIZE] + [7] * 20))
    _expect(
        second.matched_tokens == 3 * BLOCK_SIZE,
        f"the shared 3-block prefix: {second.matched_tokens} tokens reported",
    )
    _expect(len(second.load_blocks) == 3, f"3 blocks to load, specs give {second.load_blocks}")
    _expect(all(second.loaded_right), f"loaded blocks holding their prefix's KV: {second}")
    _expect(second.loaded_chunks == 3, f"stats report {second.loaded_chunks} chunks loaded")
    return {"first": vars(first), "second": vars(second)}


def full_hit(ctx) -> dict:
    engine = _engine(ctx)
    prompt = PROMPT[: 3 * BLOCK_SIZE]
    engine.prefill(engine.new_request("f1", prompt))
    engine.finish(engine.requests["f1"])
    again = engine.prefill(engine.new_request("f2", list(prompt)))
    _expect(
        again.matched_tokens == 3 * BLOCK_SIZE - 1,
        f"a full hit of 3 blocks: {again.matched_tokens} tokens reported, their rule is N-1",
    )
    _expect(len(again.load_blocks) == 3 and all(again.loaded_right), f"full hit load: {again}")
    return {"again": vars(again)}


def restart(ctx) -> dict:
    engine = _engine(ctx)
    engine.prefill(engine.new_request("r1", PROMPT))
    engine.finish(engine.requests["r1"])
    fresh = _engine(ctx)  # a restarted engine: new connectors, new runner
    after = fresh.prefill(fresh.new_request("r2", PROMPT))
    _expect(all(after.loaded_right), f"after restart, loaded blocks with wrong bytes: {after}")
    return {"hits_after_restart": after.matched_tokens // BLOCK_SIZE, "after": vars(after)}


def events(ctx) -> dict:
    engine = _engine(ctx, events=True)
    req = engine.new_request("e1", PROMPT)
    engine.prefill(req)
    engine.finish(req)
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    taken = list(engine.scheduler.take_events())
    stored = [h for e in taken if type(e).__name__ == "BlockStored" for h in e.block_hashes]
    want = [maybe_convert_block_hash(h) for h in req.block_hashes]  # vLLM's event form
    return {
        "events": [type(e).__name__ for e in taken],
        "stored_hashes_are_the_prompts": sorted(stored) == sorted(want),
        "stored": len(stored),
    }


def tier_save(ctx) -> dict:
    engine = _engine(ctx)
    first = engine.prefill(engine.new_request("t1", PROMPT))
    engine.finish(engine.requests["t1"])
    _expect(first.saved_chunks == 3, f"3 full blocks to save, {first.saved_chunks} reported")
    _expect(engine.scheduler.flush_tiers(60.0), "the tiers did not take the chunks in 60 s")
    return {"first": vars(first)}


def tier_serve(ctx) -> dict:
    engine = _engine(ctx)
    after = engine.prefill(engine.new_request("t2", PROMPT))
    _expect(
        after.matched_tokens == 3 * BLOCK_SIZE,
        f"a fresh process: {after.matched_tokens} tokens reported, the tier holds 3 blocks",
    )
    _expect(len(after.load_blocks) == 3, f"3 blocks to load, specs give {after.load_blocks}")
    _expect(all(after.loaded_right), f"blocks loaded from the tier with wrong bytes: {after}")
    _expect(after.loaded_chunks == 3, f"stats report {after.loaded_chunks} chunks loaded")
    return {"after": vars(after)}


def _run(name: str, ctx) -> dict:
    kind, *rest = name.split("/")
    if kind == "roundtrip":
        return roundtrip(ctx, *rest)
    return {
        "bucketed": bucketed,
        "hybrid": hybrid,
        "shapes": shapes,
        "engine/prefix_hit": prefix_hit,
        "engine/full_hit": full_hit,
        "engine/restart": restart,
        "engine/events": events,
        "tier/save": tier_save,
        "tier/serve": tier_serve,
    }[name if kind in ("engine", "tier") else kind](ctx)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--connector", default=THEIRS, help="module:Class under test")
    parser.add_argument("--extra-config", default="{}", help="kv_connector_extra_config JSON")
    parser.add_argument(
        "--only", nargs="+", choices=SCENARIOS + TIER_SCENARIOS, help="run only these"
    )
    args = parser.parse_args(argv)

    from tests.tpu_inference import _env

    env = _env.prepare(DEVICES)
    # Their module reads the bucket list once, at import; keep the bucketed run short.
    os.environ.setdefault("TPU_OFFLOAD_BLOCK_SIZE_BUCKETS", "1,2,4")
    os.environ.setdefault("TPU_OFFLOAD_NUM_CPU_CHUNKS", "32")
    import vllm.distributed.kv_transfer.kv_connector.v1.base as base
    from tpu_inference.offload import tpu_offload_connector as types

    from tests.tpu_inference import _engine, _their_stack

    ctx = {
        "stack": _their_stack,
        "engine": _engine,
        "types": types,
        "roles": base.KVConnectorRole,
        "cls": _their_stack.load_connector(args.connector),
        "config": _their_stack.EngineConfig(
            BLOCK_SIZE, args.connector, json.loads(args.extra_config)
        ),
        "new_config": lambda: _their_stack.EngineConfig(
            BLOCK_SIZE, args.connector, json.loads(args.extra_config)
        ),
    }
    results: dict[str, object] = {"_env": {**env, "connector": args.connector}}
    for name in args.only or SCENARIOS:
        start = time.monotonic()
        try:
            facts, error = _run(name, ctx), None
        except Exception as exc:  # every scenario reports; the caller judges
            facts, error = {}, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"
        results[name] = {
            "ok": error is None,
            "error": error,
            "facts": facts,
            "seconds": time.monotonic() - start,
        }
        print(f"{name}: {'ok' if error is None else 'FAILED'}", file=sys.stderr, flush=True)
    args.out.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
