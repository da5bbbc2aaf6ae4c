"""The certification gates of `build_offloading_config` as named, ordered checks.

Each gate is vLLM's `and` chain written as a tuple of `Check(name, test)`; `passes()`
evaluates them in order and stops at the first failure, exactly like the chain (later
tests may assume earlier ones held, e.g. that there is a single group). The translation
uses the verdicts; `explain()` shows the same checks to people.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jax_kvoffload.config._specs import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    iter_layer_specs,
)


@dataclass(frozen=True)
class Check:
    """One condition of a gate: `name` says it as a sentence, `test` evaluates it."""

    name: str
    test: Callable[[], bool]


@dataclass(frozen=True)
class Verdict:
    """A check's outcome; `passed` is None when an earlier check already failed."""

    name: str
    passed: bool | None


def passes(checks: Sequence[Check]) -> bool:
    return all(bool(c.test()) for c in checks)


def verdicts(checks: Sequence[Check]) -> tuple[Verdict, ...]:
    out: list[Verdict] = []
    failed = False
    for c in checks:
        if failed:
            out.append(Verdict(c.name, None))
            continue
        ok = bool(c.test())
        out.append(Verdict(c.name, ok))
        failed = not ok
    return tuple(out)


def spec_certifiable(spec: KVCacheSpec, tp_size: int, total_kv_heads: int) -> bool:
    """Conservative static mirror of the canonical mapping's per-layer checks
    (`_layer_mapping` in vLLM's `kv_connector/v1/offloading/canonical_mapping.py`)."""
    if not isinstance(spec, AttentionSpec):
        return False
    if spec.kv_quant_mode.is_per_token_head:
        return False
    if type(spec) is MLAAttentionSpec:
        return spec.tokens_per_state == 1 and spec.real_page_size_bytes % spec.block_size == 0
    if isinstance(spec, (SlidingWindowMLASpec, MLAAttentionSpec)):
        return False
    if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
        return False
    heads_divide = total_kv_heads % tp_size == 0 or tp_size % total_kv_heads == 0
    return heads_divide and spec.num_kv_heads == max(1, total_kv_heads // tp_size)


def replicated_checks(engine: Any, kv: Any, worker_bytes: int) -> tuple[Check, ...]:
    """vLLM's default replicated-layout gate: MLA over TP, single-node "mp" only."""
    p = engine.parallel_config
    tp = p.tensor_parallel_size
    return (
        Check("the model uses MLA", lambda: engine.model_config.use_mla),
        Check("tensor parallel size > 1", lambda: tp > 1),
        Check("kv_tp_replicas == tensor parallel size", lambda: kv.kv_tp_replicas == tp),
        Check("worker KV bytes per block > 0", lambda: worker_bytes > 0),
        Check("pipeline parallel size == 1", lambda: p.pipeline_parallel_size == 1),
        Check("prefill context parallel size == 1", lambda: p.prefill_context_parallel_size == 1),
        Check("decode context parallel size == 1", lambda: p.decode_context_parallel_size == 1),
        Check("world size == tensor parallel size", lambda: p.world_size == tp),
        Check("executor backend is 'mp'", lambda: p.distributed_executor_backend == "mp"),
        Check("one node per data-parallel rank", lambda: p.nnodes_within_dp == 1),
    )


def agnostic_checks(engine: Any, kv: Any) -> tuple[Check, ...]:
    """vLLM's default agnostic gate: one non-MLA full-attention group, head-sharded."""
    p = engine.parallel_config
    groups = kv.kv_cache_groups

    def spec() -> Any:
        return groups[0].kv_cache_spec

    return (
        Check("not the V2 model runner", lambda: not engine.use_v2_model_runner),
        Check("exactly one KV cache group", lambda: len(groups) == 1),
        Check("the group is full attention", lambda: isinstance(spec(), FullAttentionSpec)),
        Check("the group is not MLA", lambda: not isinstance(spec(), MLAAttentionSpec)),
        Check(
            "num_kv_heads * tensor parallel size == total KV heads (no GQA replication)",
            lambda: (
                spec().num_kv_heads * p.tensor_parallel_size
                == engine.model_config.get_total_num_kv_heads()
            ),
        ),
        Check(
            "no per-token-head quantisation",
            lambda: not spec().kv_quant_mode.is_per_token_head,
        ),
        Check("decode context parallel size == 1", lambda: p.decode_context_parallel_size == 1),
        Check("prefill context parallel size == 1", lambda: p.prefill_context_parallel_size == 1),
    )


def canonical_agnostic_checks(engine: Any, kv: Any) -> tuple[Check, ...]:
    """The canonical widening: every layer of every group certifiable, no CP."""
    p = engine.parallel_config
    tp = p.tensor_parallel_size
    layer_specs = [s for g in kv.kv_cache_groups for s in iter_layer_specs(g.kv_cache_spec)]
    total = engine.model_config.get_total_num_kv_heads()
    return (
        Check("at least one layer", lambda: len(layer_specs) > 0),
        Check(
            "every layer of every group is certifiable (spec_certifiable)",
            lambda: all(spec_certifiable(s, tp, total) for s in layer_specs),
        ),
        Check("decode context parallel size == 1", lambda: p.decode_context_parallel_size == 1),
        Check("prefill context parallel size == 1", lambda: p.prefill_context_parallel_size == 1),
        Check("world size == tensor parallel size", lambda: p.world_size == tp),
    )


def canonical_replicated_checks(
    engine: Any, selected: Sequence[tuple[int, Any]], agnostic: bool
) -> tuple[Check, ...]:
    """Replication recomputed under the canonical layout, from the spec types."""
    p = engine.parallel_config
    return (
        Check("parallelism agnostic", lambda: agnostic),
        Check(
            "every offloaded layer is exactly MLAAttentionSpec",
            lambda: all(
                type(s) is MLAAttentionSpec
                for _, g in selected
                for s in iter_layer_specs(g.kv_cache_spec)
            ),
        ),
        Check("one node per data-parallel rank", lambda: p.nnodes_within_dp == 1),
        Check(
            "world size == 1 or executor backend is 'mp'",
            lambda: p.world_size == 1 or p.distributed_executor_backend == "mp",
        ),
    )
