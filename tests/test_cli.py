"""The command line: `config explain` on good and bad files, and the help."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jax_kvoffload.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_the_commands(capsys):
    code, out, _ = run(capsys)
    assert code == 0
    assert "config" in out


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.json")))
def test_explain_the_shipped_examples(capsys, name):
    code, out, err = run(capsys, "config", "explain", str(EXAMPLES / name))
    assert (code, err) == (0, "")
    assert "OffloadingConfig" in out
    assert "=> is_parallelism_agnostic:" in out


def test_explain_says_which_check_decided(capsys):
    code, out, _ = run(capsys, "config", "explain", str(EXAMPLES / "llama-tp2.json"))
    assert code == 0
    assert "blocks_per_chunk=4" in out
    assert "replicated_layout: False\n    [NO ] the model uses MLA" in out


def test_explain_json_parses(capsys):
    code, out, _ = run(
        capsys, "config", "explain", "--json", str(EXAMPLES / "deepseek-mla-canonical.json")
    )
    assert code == 0
    data = json.loads(out)
    assert data["offloading_config"]["replicated_layout"] is True
    gate = data["why"]["is_parallelism_agnostic"]["canonical_gate"]
    assert all(row["passed"] for row in gate)


def write(tmp_path: Path, data) -> str:
    path = tmp_path / "cfg.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def good() -> dict:
    return json.loads((EXAMPLES / "llama-tp2.json").read_text())


def mutate(fn):
    data = good()
    fn(data)
    return data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("{not json", "not valid JSON"),
        ({"engine": {}}, "missing keys ['kv_cache']"),
        (mutate(lambda d: d["engine"].update(typo=1)), "engine: unknown keys ['typo']"),
        (
            mutate(
                lambda d: d["kv_cache"]["kv_cache_groups"][0]["kv_cache_spec"].update(type="Nope")
            ),
            "kv_cache.kv_cache_groups[0].kv_cache_spec.type: unknown spec 'Nope'",
        ),
        (
            mutate(
                lambda d: d["kv_cache"]["kv_cache_groups"][0]["kv_cache_spec"].update(block_size=0)
            ),
            "kv_cache.kv_cache_groups[0].kv_cache_spec.block_size: must be >= 1, got 0",
        ),
        (
            mutate(lambda d: d["engine"]["model_config"].update(dtype="float13")),
            "engine.model_config.dtype: unknown dtype name 'float13'",
        ),
        (
            mutate(lambda d: d["engine"]["parallel_config"].update(rank=5)),
            "engine.parallel_config.rank: 5 is not in [0, world_size=2)",
        ),
        (
            mutate(
                lambda d: d["engine"]["kv_transfer_config"]["kv_connector_extra_config"].update(
                    block_size=40
                )
            ),
            "Use 48 instead",
        ),
    ],
)
def test_bad_files_give_one_clear_line_and_exit_2(capsys, tmp_path, data, message):
    code, out, err = run(capsys, "config", "explain", write(tmp_path, data))
    assert code == 2
    assert out == ""
    assert err.startswith("error: ")
    assert message in err
    assert "Traceback" not in err


def extra(value_text: str) -> str:
    """The good description with `"block_size": <value_text>` in the extra config."""
    text = json.dumps(good())
    return text.replace('"kv_connector_extra_config": {', '"kv_connector_extra_config": '
                        '{"x": ' + value_text + ", ", 1)  # fmt: skip


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff\xfe{}", "is not UTF-8 text (byte 0xff at offset 0)"),
        (extra("9" * 5000), "an integer of 5000 digits is too large"),
        (extra("Infinity"), "Infinity is not a JSON number; use a finite number"),
        (extra("-Infinity"), "-Infinity is not a JSON number"),
        (extra("NaN"), "NaN is not a JSON number"),
        (extra("[" * 40 + "]" * 40), "nests deeper than a description can"),
        ("[" * 100_000 + "]" * 100_000, "nests deeper than a description can"),
        ("[1, 2]", "expected an object with 'engine' and 'kv_cache'"),
        (" " * (1 << 20) + "{}", "is larger than 1048576 bytes"),
        (
            mutate(lambda d: d["engine"]["cache_config"].update(block_size="16")),
            "engine.cache_config.block_size: must be an int, got str '16'",
        ),
        (
            mutate(lambda d: d["engine"]["cache_config"].update(block_size=16.5)),
            "engine.cache_config.block_size: must be an int, got float 16.5",
        ),
        (
            mutate(lambda d: d["engine"]["model_config"].update(dtype="complex64")),
            "engine.model_config.dtype: 'complex64' (numpy kind 'c') is not a KV cache",
        ),
        (
            mutate(lambda d: d["engine"]["model_config"].update(dtype=["bfloat16"])),
            "engine.model_config.dtype: expected a dtype or a dtype name, got list",
        ),
        (
            mutate(lambda d: d["kv_cache"]["kv_cache_groups"][0].update(layer_names="l0")),
            "kv_cache.kv_cache_groups[0].layer_names: expected a list, got a string",
        ),
        (
            mutate(lambda d: d["kv_cache"]["kv_cache_groups"][0].update(role=["x"])),
            "kv_cache.kv_cache_groups[0].role: unknown role ['x']",
        ),
        (
            mutate(
                lambda d: d["engine"]["kv_transfer_config"]["kv_connector_extra_config"].update(
                    block_size=[64]
                )
            ),
            "kv_connector_extra_config['block_size']: must be an integer or a string of one, "
            "got list [64]",
        ),
        (
            mutate(
                lambda d: d["engine"]["kv_transfer_config"]["kv_connector_extra_config"].update(
                    block_size="x"
                )
            ),
            "kv_connector_extra_config['block_size']='x' is not an integer",
        ),
    ],
)
def test_hostile_files_give_one_line_naming_the_problem(capsys, tmp_path, data, message):
    path = tmp_path / "cfg.json"
    if isinstance(data, bytes):
        path.write_bytes(data)
    else:
        path.write_text(data if isinstance(data, str) else json.dumps(data))
    for flags in ((), ("--json",)):
        code, out, err = run(capsys, "config", "explain", *flags, str(path))
        assert (code, out) == (2, ""), err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert message in err, err
        assert "Traceback" not in err


def test_a_directory_is_one_line_too(capsys, tmp_path):
    code, out, err = run(capsys, "config", "explain", str(tmp_path))
    assert (code, out) == (2, "")
    assert err == f"error: {tmp_path}: Is a directory\n"


def test_json_output_is_strict_json(capsys, tmp_path):
    data = mutate(
        lambda d: d["engine"]["kv_transfer_config"]["kv_connector_extra_config"].update(
            tiers=[{"medium": "disk", "big": 1.5e308}], ratio=0.1
        )
    )
    code, out, _ = run(capsys, "config", "explain", "--json", write(tmp_path, data))
    assert code == 0

    def refuse(name):
        raise AssertionError(f"{name} in --json output")

    parsed = json.loads(out, parse_constant=refuse)
    extra_out = parsed["offloading_config"]["extra_config"]
    assert extra_out["tiers"] == [{"medium": "disk", "big": 1.5e308}]


def test_missing_file(capsys, tmp_path):
    code, _, err = run(capsys, "config", "explain", str(tmp_path / "absent.json"))
    assert code == 2
    assert "No such file or directory" in err


def test_module_entry_point_runs():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jax_kvoffload",
            "config",
            "explain",
            str(EXAMPLES / "llama-tp2.json"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "tokens_per_hash=16" in out.stdout


def test_bench_runs_a_benchmark_script(capsys, tmp_path):
    code, out, _ = run(
        capsys, "bench", "manager", "--quick", "--requests", "300", "--out", str(tmp_path)
    )
    assert code == 0
    assert (tmp_path / "manager.csv").read_text().count("\n") >= 3  # header + LRU + ARC
    assert "# manager benchmark" in out and "lookups" in out and "M/s" in out


def test_bench_rejects_unknown_names(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "nope"])
    assert exc.value.code == 2


def test_bench_without_a_name_lists_the_benchmarks(capsys):
    """A missing name is the only error (not "required: name, args": the script's
    arguments are optional)."""
    with pytest.raises(SystemExit) as exc:
        main(["bench"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "name a benchmark: one of kernels" in err and "args" not in err.splitlines()[-1]


def test_bench_offers_every_benchmark_script():
    """`jax-kvoffload bench NAME` lists each timing script of benchmarks/ (not the modules
    they import, named `_*.py`, not the deviceless-compile tool)."""
    from pathlib import Path

    from jax_kvoffload.cli import BENCHMARKS

    scripts = {p.stem for p in (Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py")}
    helpers = {s for s in scripts if s.startswith("_")}  # _report, _tiers_disk, ...
    assert "_report" in helpers
    assert set(BENCHMARKS) == scripts - helpers - {"deviceless_compile"}


def test_top_level_help_names_every_benchmark(capsys):
    from jax_kvoffload.cli import BENCHMARKS

    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert all(name in out for name in BENCHMARKS), out  # tiers and pools were missing


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["demo", "--no-such-flag"], "usage: jax-kvoffload demo"),
        (["config", "explain", "x.json", "--no-such-flag"], "usage: jax-kvoffload config explain"),
    ],
)
def test_an_unknown_flag_shows_the_subcommands_usage(capsys, argv, usage):
    """The usage printed with the error lists the flags that do exist (argparse printed
    the top-level `jax-kvoffload [-h] COMMAND ...`, which lists none of them)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and "unrecognized arguments: --no-such-flag" in err, err
