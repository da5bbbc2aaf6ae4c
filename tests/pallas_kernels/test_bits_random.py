"""Every backend moves bits: random cases against a plain numpy model of the bits.

Caches hold special patterns (subnormals, NaN payloads, -0.0) and random bits, in every
layout and dtype, with tiny and degenerate shapes (one block, one element) and repeated
gather ids, where XLA rewrites a gather into a broadcast. The issue-12 defects: on
XLA:CPU any copy left in bf16/fp8 runs through f32, flushing subnormals (0x807F ->
0x8000) and quieting NaNs (0x7F81 -> 0x7FC1). A scatter must also leave every page it
does not name bit-identical.

The seed is printed and can be replayed: ``PK_BITS_SEED=<seed>``. ``PK_BITS_CASES``
sets the number of random cases per CPU backend (CI default 14, every layout at least
once; the interpreters take a fifth as many), on top of one hazard case per layout.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import pallas_kernels as pk

from .bitmodel import (
    LAYOUTS,
    BitCase,
    bits_of,
    case_from,
    draw_case,
    model_gather,
    model_scatter,
)

SEED = int(os.environ.get("PK_BITS_SEED", time.time_ns() % 2**31))
CASES = int(os.environ.get("PK_BITS_CASES", "14"))
print(f"test_bits_random: PK_BITS_SEED={SEED} PK_BITS_CASES={CASES}")

_CONFIG = {"xla": pk.XlaConfig, "tpu": pk.TpuConfig, "triton": pk.TritonConfig}
_CONFIG["mosaic_gpu"] = pk.MosaicGpuConfig
INTERPRETED = [b for b in ("tpu", "triton", "mosaic_gpu") if pk.get_backend(b).can_interpret()]


def _kw(backend: str, case: BitCase) -> dict:
    kw: dict = {"layout": case.kv_layout, "backend": backend}
    if backend != "reference":
        kw["config"] = _CONFIG[backend](word_bytes=case.word_bytes)
    if backend in INTERPRETED:
        kw["interpret"] = True
    return kw


def check_case(backend: str, case: BitCase, tag: str) -> None:
    """Gather and scatter of ``case`` with ``backend`` equal the numpy model, bit for bit."""
    where = f"{tag}: backend={backend} {case!r}; replay with PK_BITS_SEED={SEED}"
    axis = case.kv_layout.block_axis
    staged = pk.gather_blocks(case.arrays(), case.gather_ids, **_kw(backend, case))
    want = model_gather(case.caches, case.gather_ids, axis)
    got = bits_of(staged)
    assert got.shape == want.shape, where
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (
        f"gather changed {bad.size}/{got.size} elements, first {hex(want.flat[bad[0]])} -> "
        f"{hex(got.flat[bad[0]])}; {where}"
    )

    out = pk.scatter_blocks(
        case.arrays(), case.scatter_ids, case.update_array(), **_kw(backend, case)
    )
    expected = model_scatter(case.caches, case.scatter_ids, case.update, axis)
    untouched = np.setdiff1d(np.arange(case.shape[axis]), case.scatter_ids)
    for layer, (o, e, before) in enumerate(zip(out, expected, case.caches, strict=True)):
        o = bits_of(o)
        kept = np.take(o, untouched, axis=axis)
        assert np.array_equal(kept, np.take(before, untouched, axis=axis)), (
            f"scatter changed untouched pages {untouched.tolist()} of array {layer}; {where}"
        )
        bad = np.flatnonzero(o != e)
        assert bad.size == 0, (
            f"scatter wrote {bad.size}/{o.size} wrong elements into array {layer}, first "
            f"{hex(e.flat[bad[0]])} -> {hex(o.flat[bad[0]])}; {where}"
        )


def _issue_cases() -> dict[str, BitCase]:
    """Inputs like those issue 12 reported: bf16 bits that a detour through f32 changes
    (each failed on the old code for the backends noted)."""
    pattern = np.array([0x807F, 0x0001, 0x7F81], np.uint16)

    def cache(shape, roll=0):
        return np.resize(np.roll(pattern, roll), shape).astype(np.uint16)

    return {
        # reference: 2-element pages, 0x0001 -> 0x0000
        "small-pages": case_from("nhd", "bf16", (4, 1, 2, 1), [cache((4, 1, 2, 1))], [0, 1, 2]),
        # reference and xla: a one-block cache gathered three times becomes a broadcast
        "one-block-repeated-ids": case_from(
            "nhd", "bf16", (1, 1, 1, 3), [cache((1, 1, 1, 3))], [0, 0, 0], [0]
        ),
        "one-block-16-tokens": case_from(
            "nhd",
            "bf16",
            (1, 16, 1, 3),
            [cache((1, 16, 1, 3)), cache((1, 16, 1, 3), 1)],
            [0, 0, 0],
            [0],
        ),
        # reference: one-element pages
        "one-element-pages": case_from("nhd", "bf16", (3, 2, 1, 1), [cache((3, 2, 1, 1))], [2, 0]),
    }


ISSUE = _issue_cases()
CPU_BACKENDS = ["reference", "xla"]
LAYOUT_NAMES = list(LAYOUTS)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", list(ISSUE))
def test_reported_bit_changes_are_gone(backend, name):
    check_case(backend, ISSUE[name], name)


@pytest.mark.parametrize("backend", INTERPRETED)
def test_reported_bit_changes_are_gone_interpreted(backend):
    check_case(backend, ISSUE["one-block-repeated-ids"], "one-block-repeated-ids")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_random_cases_move_bits(backend):
    """Every layout at least once per run (they take turns); dtypes and sizes drawn."""
    rng = np.random.default_rng([SEED, CPU_BACKENDS.index(backend)])
    for k in range(CASES):
        layout = LAYOUT_NAMES[k % len(LAYOUT_NAMES)]
        check_case(backend, draw_case(rng, layout=layout), f"case {k}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_random_hazard_cases_move_bits(backend):
    """bf16 in the shapes of the issue-12 defects, each layout once per run: without the
    fence about half of these changed bits on the reference backend, and some on xla."""
    rng = np.random.default_rng([SEED, 20 + CPU_BACKENDS.index(backend)])
    for k, layout in enumerate(n for n in LAYOUT_NAMES if n != "raw"):  # raw holds ints
        check_case(backend, draw_case(rng, layout=layout, dtype="bf16", hazard=True), f"hazard {k}")


@pytest.mark.parametrize("backend", INTERPRETED)
def test_random_cases_move_bits_interpreted(backend):
    rng = np.random.default_rng([SEED, 10 + INTERPRETED.index(backend)])
    for k in range(max(1, CASES // 5)):
        check_case(backend, draw_case(rng, max_blocks=3), f"case {k}")
