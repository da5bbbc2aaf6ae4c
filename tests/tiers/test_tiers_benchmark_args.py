"""benchmarks/tiers.py refuses nonsense arguments with a clear error, before running
(as tests/test_benchmark_args.py does for the other scripts): only its parser runs."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "tiers.py"


def load():
    spec = importlib.util.spec_from_file_location("_bench_args_tiers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


REFUSED = [
    (["--dir", "/nonexistent/jkv-bench"], "--dir: '/nonexistent/jkv-bench' does not exist"),
    (["--dir", "/nonexistent/jkv-bench"], "mkdir -p /nonexistent/jkv-bench"),
    (["--dir", __file__], "is not a directory"),
    (["--chunks", "0"], "--chunks: must be an integer >= 1, got 0"),
    (["--repeats", "-2"], "--repeats: must be an integer >= 1, got -2"),
    (["--values", "x"], "--values: must be an integer >= 1, got 'x'"),
    (["--chunk-mib", "0"], "--chunk-mib: must be a finite number > 0, got 0"),
    (["--value-kib", "nan"], "--value-kib: must be a finite number > 0, got nan"),
    (["--chunk-mib", "1e-9"], "a chunk or value must be at least one byte"),
    (["--batch-mib", "0"], "--batch-mib: must be an integer >= 1, got 0"),
    (["--direct-io", "yes"], "--direct-io: invalid choice: 'yes'"),
    (["--redis-url", "http://h:1"], "--redis-url"),
    (["--redis-url", "unix:///tmp/r.sock"], "give a redis://host:port/db URL"),
]


@pytest.mark.parametrize(("argv", "message"), REFUSED, ids=lambda v: str(v))
def test_nonsense_is_refused_with_the_rule(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        load().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_directory_it_cannot_write_is_refused(capsys, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(SystemExit):
        load().parse_args(["--dir", str(ro)])
    assert "is not writable by this user" in capsys.readouterr().err


def test_sensible_arguments_parse(tmp_path):
    args = load().parse_args(
        ["--quick", "--dir", str(tmp_path), "--repeats", "2", "--redis-url", "redis://h:7/1"]
    )
    assert (args.dir, args.chunks, args.values, args.repeats) == (str(tmp_path), 48, 64, 2)
    assert load().parse_args([]).chunks == 256


@pytest.mark.skipif(shutil.which("redis-benchmark") is None, reason="needs redis-benchmark")
def test_the_get_baseline_moves_a_value_with_every_get(redis_server):
    """redis-benchmark -r n draws keys with repeats: after its SET pass ~37 % of them are
    missing, and GETs of missing keys moved no value but counted as if they had."""
    bench = load()
    redis_server.call(b"FLUSHALL")
    misses = bench.fill_benchmark_keys(redis_server.url, 64, 1024)
    assert redis_server.call(b"DBSIZE") == 64
    bench.redis_benchmark("127.0.0.1", redis_server.port, "get", 1024, 64, 4, 4, keyspace=64)
    assert bench.fill_benchmark_keys(redis_server.url, 0, 1024) == misses  # none missed
    assert redis_server.call(b"DBSIZE") == 64  # and every GET read one of those keys
