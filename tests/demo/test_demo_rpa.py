"""The demo with `--layout rpa`: its model keeps the KV cache in tpu-inference's
ragged-paged-attention v3 layout, and a prefix loaded into it still gives logits
bit-identical to a full recompute."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload.cli import build_parser
from jax_kvoffload.demo import DemoConfigError, DemoModelConfig, ScenarioConfig, run_scenario
from jax_kvoffload.demo._model import DemoTransformer, make_forward
from jax_kvoffload.demo._serving import empty_caches

SMALL = dict(vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=64)


def _scenario(**changes) -> dict:
    cfg = ScenarioConfig(
        model=DemoModelConfig(**SMALL, cache_layout="rpa"), block_size=8, prompt_blocks=4,
        suffix_tokens=12, blocks_per_chunk=2, decode_tokens=2, **changes,
    )  # fmt: skip
    return run_scenario(cfg)


def test_a_prefix_loaded_into_rpa_caches_gives_the_recomputed_logits():
    s = _scenario()
    assert s["prefix_hit_blocks"] == 4 and s["load"]["blocks"] == 4
    # One block: every layer's [block_size, 2 * kv_heads, 1, 128] uint32 page, padding in.
    assert s["block_bytes"] == 2 * 8 * (2 * 2) * 1 * 128 * 4
    assert s["check"]["passed"] is True and s["check"]["max_abs_diff"] == 0.0


def test_skipping_the_load_fails_the_check_in_rpa_too():
    s = _scenario(skip_load=True)
    assert s["load"]["blocks"] == 0
    assert s["check"]["logits_equal"] is False and s["check"]["passed"] is False


def test_the_model_writes_k_and_v_in_their_rpa_slots():
    """The same tokens through both layouts: equal logits, and the RPA cache unpacks
    (`pk.rpa_unpack`: slot 2h is K of head h, 2h + 1 its V) to the NHD cache's K and V,
    with the lanes past head_dim left zero."""
    tokens = jnp.arange(8, dtype=jnp.int32) % 256
    table = jnp.asarray([3, 1], jnp.int32)
    out = {}
    for layout in ("nhd", "rpa"):
        model = DemoTransformer(DemoModelConfig(**SMALL, cache_layout=layout))
        caches = empty_caches(2, 4, 8, 2, 16, layout)
        logits, caches = make_forward(model)(tokens, caches, jnp.int32(0), jnp.int32(8), table)
        out[layout] = (np.asarray(logits), [np.asarray(c) for c in caches])
    assert np.array_equal(out["nhd"][0].view(np.uint32), out["rpa"][0].view(np.uint32))
    for nhd, rpa in zip(out["nhd"][1], out["rpa"][1], strict=True):
        assert rpa.shape == pk.rpa_cache_shape(4, 8, 2, 16, jnp.uint32)
        k, v = pk.rpa_unpack(rpa, 2, 16)
        assert np.array_equal(k, nhd[:, 0]) and np.array_equal(v, nhd[:, 1])
        assert not rpa[..., 16:].any()
        assert nhd[3, 0].any()  # the block the tokens went to holds them


def test_the_layout_flag_and_its_refusals():
    args = build_parser().parse_args(["demo", "--layout", "rpa"])
    assert args.layout == "rpa"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--layout", "hnd"])
    with pytest.raises(DemoConfigError, match="cache_layout='hnd'"):
        DemoModelConfig(cache_layout="hnd")
