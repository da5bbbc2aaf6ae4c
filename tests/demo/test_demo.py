"""The prefix-reuse demo: the scenario's hit, bytes and exact logits, its negative
control, the serving pieces, and `jax-kvoffload demo` (text, --json, exit codes)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_kvoffload.cli import main
from jax_kvoffload.demo import (
    BlockAllocator,
    DemoConfigError,
    DemoModelConfig,
    OutOfBlocksError,
    ScenarioConfig,
    block_hashes,
    build_offloader,
    run_scenario,
)
from jax_kvoffload.demo._report import StreamProgress
from jax_kvoffload.offloader import CacheConfigMismatchError
from jax_kvoffload.transfer import TransferError

# Small enough for CI on 2 cores (about 2 s a scenario), large enough to have GQA
# (4 query heads on 2 KV heads), two layers and a multi-chunk prefix.
SMALL = dict(vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn_dim=64)
SMALL_FLAGS = ["--vocab", "256", "--layers", "2", "--heads", "4", "--kv-heads", "2",
               "--head-dim", "16", "--ffn-dim", "64", "--prompt-blocks", "4",
               "--block-size", "8", "--suffix-tokens", "12"]  # fmt: skip


def block_bytes(m: dict, block_size: int) -> int:
    # K and V, float32 words, every layer: what one block of the group weighs.
    return m["num_layers"] * 2 * block_size * m["num_kv_heads"] * m["head_dim"] * 4


@pytest.fixture(scope="module")
def summary() -> dict:
    cfg = ScenarioConfig(
        model=DemoModelConfig(**SMALL), block_size=8, prompt_blocks=4, suffix_tokens=12,
        blocks_per_chunk=2, decode_tokens=3,
    )  # fmt: skip
    return run_scenario(cfg)


def test_b_hits_a_whole_prefix_and_moves_its_bytes(summary):
    # A's prefix is 4 blocks of 8 tokens = 2 chunks: all stored, all found by B.
    assert summary["prefix_hit_blocks"] == 4
    assert summary["prefix_hit_tokens"] == 32
    assert summary["requests"]["shared_prefix_tokens"] == 32
    nbytes = 4 * block_bytes(SMALL, 8)
    assert summary["block_bytes"] == block_bytes(SMALL, 8)
    for direction in ("store", "load"):
        moved = summary[direction]
        assert (moved["blocks"], moved["bytes"], moved["success"]) == (4, nbytes, True)
        assert moved["seconds"] > 0 and moved["gb_per_s"] > 0


def test_the_offloader_stats_count_the_scenario_after_its_warm_up(summary):
    # A stores its 2 chunks (one job); B's 5 whole blocks are 2 chunks, both hit; one load.
    st = summary["stats"]
    nbytes = 4 * block_bytes(SMALL, 8)
    assert (st["lookups"], st["hits"], st["hits_pending"], st["misses"]) == (2, 2, 0, 0)
    assert (st["hit_tokens"], st["prefix_lookups"], st["prefix_hit_tokens"]) == (32, 1, 32)
    for direction in ("store", "load"):
        totals, job = st[direction], summary[direction]
        assert (totals["jobs_completed"], totals["jobs_failed"]) == (1, 0)
        assert (totals["bytes"], totals["seconds"]) == (nbytes, job["seconds"])
    assert (st["stores_completed"], st["stores_failed"], st["stores_dropped"]) == (2, 0, 0)
    assert (st["evictions"], st["resets"]) == (0, 0)  # the warm-up's reset is before
    assert (st["occupied_chunks"], st["num_chunks"]) == (2, summary["host"]["chunks"])
    assert st["occupancy_perc"] == 2 / summary["host"]["chunks"]
    assert st["cpu_cache_usage_perc"] == 0.0  # nothing pinned or pending at the end


def test_a_blocks_were_reused_and_overwritten_before_b_loaded(summary):
    assert summary["filler_reused_A_blocks"] is True
    assert summary["A_blocks_overwritten"] is True
    assert summary["check"]["recompute_in_disjoint_blocks"] is True


def test_b_logits_equal_a_full_recompute_exactly(summary):
    check = summary["check"]
    # B computes only its 12 suffix tokens; the recompute all 44.
    assert check["positions_compared"] == 12
    assert summary["prefill"]["with_hit_tokens_computed"] == 12
    assert summary["prefill"]["full_recompute_tokens_computed"] == 44
    assert check["logits_equal"] is True
    assert check["max_abs_diff"] == 0.0
    assert check["decode_equal"] is True and len(check["decoded_tokens"]) == 3
    assert check["passed"] is True


def test_only_whole_chunks_are_offloaded():
    # 5 blocks, 2 per chunk: the 5th block is not stored, so B recomputes it.
    cfg = ScenarioConfig(
        model=DemoModelConfig(**SMALL, rope=False), block_size=8, prompt_blocks=5,
        suffix_tokens=3, blocks_per_chunk=2, decode_tokens=1,
    )  # fmt: skip
    s = run_scenario(cfg)
    assert (s["prefix_hit_blocks"], s["store"]["blocks"], s["load"]["blocks"]) == (4, 4, 4)
    assert s["check"]["positions_compared"] == 8 + 3
    assert s["check"]["passed"] is True and s["check"]["max_abs_diff"] == 0.0


def test_skipping_the_load_fails_the_check():
    # Negative control: same scenario, but B's prefix blocks are never loaded.
    cfg = ScenarioConfig(
        model=DemoModelConfig(**SMALL), block_size=8, prompt_blocks=2, suffix_tokens=4,
        blocks_per_chunk=2, decode_tokens=1, skip_load=True,
    )  # fmt: skip
    s = run_scenario(cfg)
    assert s["prefix_hit_blocks"] == 2 and s["load"]["blocks"] == 0
    assert s["check"]["logits_equal"] is False
    assert s["check"]["max_abs_diff"] > 0
    assert s["check"]["passed"] is False


def test_bad_sizes_are_named():
    with pytest.raises(DemoConfigError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
        DemoModelConfig(num_heads=6, num_kv_heads=4)
    with pytest.raises(DemoConfigError, match="use prompt_blocks >= 4"):
        ScenarioConfig(prompt_blocks=2, blocks_per_chunk=4)


# -- serving pieces ------------------------------------------------------------------


def test_allocator_hands_out_the_last_freed_blocks_first():
    alloc = BlockAllocator(6)
    a = alloc.allocate(3)
    b = alloc.allocate(2)
    assert (a, b) == ([0, 1, 2], [3, 4])
    alloc.free(a)
    assert alloc.allocate(3) == [0, 1, 2]  # A's blocks, in A's order
    with pytest.raises(OutOfBlocksError, match="need 2 blocks but only 1 of 6 are free"):
        alloc.allocate(2)


def test_block_hashes_chain_over_the_prefix():
    tokens = list(range(20))
    h = block_hashes(tokens, 8)
    assert len(h) == 2  # the partial third block has no hash
    assert block_hashes(tokens[:16] + [99] * 8, 8)[:2] == h
    # Changing block 0 changes every later hash; changing block 1 leaves block 0's.
    assert block_hashes([1, *tokens[1:]], 8)[1] != h[1]
    assert block_hashes(tokens[:8] + [7] * 8, 8)[0] == h[0]
    assert all(isinstance(x, bytes) and len(x) == 32 for x in h)


def test_set_caches_keeps_shapes_and_dtypes():
    cfg = ScenarioConfig(model=DemoModelConfig(**SMALL), block_size=8, prompt_blocks=2)
    with build_offloader(cfg, num_blocks=4) as off:
        arrays = off.caches()
        new = [a + jnp.uint32(1) for a in arrays]
        off.set_caches(new)
        assert all(x is y for x, y in zip(off.caches(), new))
        with pytest.raises(TransferError, match="must keep the shapes and dtypes"):
            off.set_caches(new[:1])
        with pytest.raises(CacheConfigMismatchError, match=r"int32 but the config's .* float32"):
            off.set_caches([a.astype(jnp.int32) for a in new])  # uint32 words hold float32
        with pytest.raises(TypeError, match=r"list of jax\.Array"):
            off.set_caches([np.asarray(a) for a in new])
        jax.block_until_ready(off.caches())


# -- command line --------------------------------------------------------------------


def test_cli_json_is_the_only_stdout(capsys):
    code = main(["demo", "--json", *SMALL_FLAGS])
    out, err = capsys.readouterr()
    assert code == 0
    data = json.loads(out)
    assert data["check"]["passed"] is True
    assert data["prefix_hit_tokens"] == 32
    assert data["store"]["bytes"] == data["load"]["bytes"] == 4 * block_bytes(SMALL, 8)
    assert data["stats"]["hits"] == 2 and data["stats"]["store"]["jobs_completed"] == 1
    assert "prefill B: done" in err  # progress goes to stderr


def test_cli_table_and_failing_exit_code(capsys):
    code = main(["demo", "--quiet", "--skip-load", *SMALL_FLAGS])
    out, err = capsys.readouterr()
    assert code == 1
    assert err == ""
    for row in ("prefix tokens hit", "stored, device->host", "loaded, host->device",
                "prefill B with hit", "prefill B, no hit", "logits check",
                "chunk lookups", "host tier now", "jobs since warm-up"):  # fmt: skip
        assert row in out
    assert "FAIL" in out


def test_cli_bad_sizes_exit_2(capsys):
    code = main(["demo", "--heads", "6", "--kv-heads", "4"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.startswith("error: num_heads=6 must be a multiple")


def test_module_entry_and_core_import_graph():
    # `python -m jax_kvoffload demo --help` works, and the core never imports the demo.
    probe = (
        "import sys, runpy\n"
        "import jax_kvoffload, jax_kvoffload.cli\n"
        "from jax_kvoffload import KVOffloader, GroupCaches\n"
        "import jax_kvoffload.config, jax_kvoffload.store, jax_kvoffload.transfer\n"
        "assert 'jax_kvoffload.demo' not in sys.modules\n"
        "assert 'flax' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True)
    done = subprocess.run(
        [sys.executable, "-m", "jax_kvoffload", "demo", "--help"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "--prompt-blocks" in done.stdout and "--json" in done.stdout


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def test_progress_redraws_on_a_terminal_and_logs_lines_elsewhere():
    tty, log = _Stream(True), _Stream(False)
    for stream in (tty, log):
        progress = StreamProgress(stream, width=4)
        for done in (1, 2):
            progress("prefill A", done, 2)
    assert tty.getvalue() == (
        "\r  prefill A            [##..] 1/2\r  prefill A            [####] 2/2\n"
    )
    assert log.getvalue() == "  prefill A: done (2 steps)\n"
