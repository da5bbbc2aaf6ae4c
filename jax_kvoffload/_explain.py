"""`jax-kvoffload config explain`: the resulting OffloadingConfig and why each flag is set."""

from __future__ import annotations

import json
from typing import TypedDict

from jax_kvoffload.config import OffloadingConfig, build_offloading_config
from jax_kvoffload.config.internals import (
    Certification,
    Verdict,
    certify,
    get_offloading_group_ids,
    load_description,
)

_MARK = {True: "yes", False: "NO ", None: " - "}


class Explanation(TypedDict):
    """What `explain_file` found: the config and the certification behind its flags."""

    config: OffloadingConfig
    certification: Certification


def explain_file(path: str) -> Explanation:
    """Builds the config described in `path` and the verdicts behind its three flags."""
    engine, kv = load_description(path)
    config = build_offloading_config(engine, kv)
    selected = [(gid, kv.kv_cache_groups[gid]) for gid in get_offloading_group_ids(kv)]
    cert = certify(engine, kv, selected, config.worker_kv_bytes_per_block)
    return {"config": config, "certification": cert}


def _verdict_rows(verdicts: tuple[Verdict, ...]) -> list[dict[str, object]]:
    return [{"check": v.name, "passed": v.passed} for v in verdicts]


def as_json(result: Explanation) -> str:
    """Strict JSON (`allow_nan=False`: the loader refuses NaN and Infinity already)."""
    config = result["config"]
    cert = result["certification"]
    return json.dumps(
        {
            "offloading_config": config.to_dict(),
            "why": {
                "canonical_layout": "extra_config['canonical_layout'] read by truthiness",
                "is_parallelism_agnostic": {
                    "default_gate": _verdict_rows(cert.agnostic),
                    "canonical_gate": (
                        None
                        if cert.canonical_agnostic is None
                        else _verdict_rows(cert.canonical_agnostic)
                    ),
                },
                "replicated_layout": _verdict_rows(cert.replicated),
            },
        },
        indent=2,
        allow_nan=False,
    )


def _gate(title: str, value: bool, verdicts: tuple[Verdict, ...]) -> list[str]:
    lines = [f"{title}: {value}"]
    lines += [f"    [{_MARK[v.passed]}] {v.name}" for v in verdicts]
    return lines


def as_text(result: Explanation) -> str:
    config = result["config"]
    cert = result["certification"]
    lines = ["OffloadingConfig"]
    for g in config.groups:
        window = g.sliding_window_size_in_chunks
        lines.append(
            f"  group {g.group_id}: {len(g.layer_names)} layers, "
            f"{g.tokens_per_block} tokens/block, window "
            f"{'unbounded' if window is None else f'{window} chunks'}"
        )
    lines += [
        f"  tokens_per_hash={config.cache.tokens_per_hash} "
        f"blocks_per_chunk={config.cache.blocks_per_chunk}",
        f"  worker_kv_bytes_per_block={config.worker_kv_bytes_per_block}",
        f"  model={config.model.name} dtype={config.model.dtype} "
        f"max_model_len={config.model.max_model_len}",
        f"  parallel: rank {config.parallel.rank}/{config.parallel.world_size} "
        f"tp={config.parallel.tp_size} pp={config.parallel.pp_size} "
        f"pcp={config.parallel.pcp_size} dcp={config.parallel.dcp_size}",
        f"  events={config.enable_kv_cache_events} kv_cache_layout={config.kv_cache_layout}",
        "",
        f"canonical_layout: {config.canonical_layout} "
        "(extra_config['canonical_layout'], read by truthiness)",
    ]
    default_agnostic = all(v.passed for v in cert.agnostic)
    lines += _gate("is_parallelism_agnostic, default gate", default_agnostic, cert.agnostic)
    if cert.canonical_agnostic is not None:
        lines += _gate(
            "is_parallelism_agnostic, canonical gate",
            config.parallel.is_parallelism_agnostic,
            cert.canonical_agnostic,
        )
    lines.append(f"=> is_parallelism_agnostic: {config.parallel.is_parallelism_agnostic}")
    title = "replicated_layout (canonical path)" if config.canonical_layout else "replicated_layout"
    lines += _gate(title, config.replicated_layout, cert.replicated)
    return "\n".join(lines)
