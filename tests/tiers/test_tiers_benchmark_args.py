"""benchmarks/tiers.py refuses nonsense arguments with a clear error, before running
(as tests/test_benchmark_args.py does for the other scripts): only its parser runs."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
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
    (["--no-disk", "--dir", "/tmp"], "--dir: names the directory the disk part measures"),
    (["--no-redis", "--redis-url", "redis://h:7/1"], "--redis-url: belongs to the Redis part"),
    (["--no-redis", "--clients"], "--clients: belongs to the Redis part, which --no-redis"),
    (["--json", "yes"], "unrecognized arguments: yes"),
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
    bench = load()._tiers_redis
    redis_server.call(b"FLUSHALL")
    misses = bench.fill_benchmark_keys(redis_server.url, 64, 1024)
    assert redis_server.call(b"DBSIZE") == 64
    bench.redis_benchmark("127.0.0.1", redis_server.port, "get", 1024, 64, 4, 4, keyspace=64)
    assert bench.fill_benchmark_keys(redis_server.url, 0, 1024) == misses  # none missed
    assert redis_server.call(b"DBSIZE") == 64  # and every GET read one of those keys


# -- the output: one JSON document, and the numpy CRC32C fallback said everywhere ----------


def _direct_io_works(path: Path) -> bool:
    """The disk part's sequential baseline opens O_DIRECT (tmpfs before Linux 6.6: no)."""
    try:
        os.close(os.open(path / "probe", os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600))
    except OSError:
        return False
    finally:
        (path / "probe").unlink(missing_ok=True)
    return True


def tiny(tmp_path: Path, *extra: str) -> list[str]:
    """A disk-only run of two 64 KiB chunks, once: a second, the real code path."""
    if not _direct_io_works(tmp_path):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    sizes = ["--repeats", "1", "--chunks", "2", "--chunk-mib", "0.0625"]
    where = ["--dir", str(tmp_path), "--out", str(tmp_path / "out")]
    return ["--no-redis", *sizes, *where, "--quiet", *extra]


def strict_json(text: str) -> dict:
    """json.loads that refuses NaN / Infinity (not JSON: jq and browsers reject them)."""

    def refuse(name):
        raise ValueError(f"{name} in the JSON document")

    return json.loads(text, parse_constant=refuse)


def test_json_is_one_document_with_the_crc_backend(capsys, tmp_path):
    """`--json`: stdout is one strict JSON document {benchmark, date, machine, ...,
    crc32c_backend, targets_apply, rows}, rows in SI units with the ratio and the target."""
    from jax_kvoffload.tiers import _crc

    bench = load()
    assert bench.main(tiny(tmp_path, "--json")) == 0
    doc = strict_json(capsys.readouterr().out)
    assert doc["benchmark"] == "tiers"
    assert {"date", "machine", "cpus", "python", "note", "repeats"} <= doc.keys()
    assert doc["crc32c_backend"] == _crc.CRC32C_BACKEND
    assert doc["targets_apply"] is (_crc.CRC32C_BACKEND != "numpy")
    assert all(tuple(r) == bench.ROW_FIELDS for r in doc["rows"])
    tiers = [r for r in doc["rows"] if r["kind"] == "tier"]
    assert [(r["op"], r["target"], r["bytes"]) for r in tiers] == [
        ("store", 0.8, 2 << 16),
        ("load", 0.8, 2 << 16),
    ]
    for r in tiers:
        assert r["GBps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
        assert r["ratio"] == pytest.approx(r["GBps"] / r["baseline_GBps"])
        if doc["targets_apply"]:
            assert r["target_met"] is (r["ratio"] >= 0.8)
    kinds = [r["kind"] for r in doc["rows"]]
    assert kinds.count("checksum") >= 1 and kinds.count("baseline") == 6
    assert (tmp_path / "out" / "tiers.csv").exists()


def test_the_numpy_fallback_is_said_in_header_table_and_json(capsys, tmp_path, monkeypatch):
    """On the numpy CRC32C (the README's plain install) the ratios come out 0.10-0.21, far
    below the targets: the output says why, in the `#` header, above the table, in the
    `met` column and in the JSON (`targets_apply: false`); it still runs."""
    from jax_kvoffload.tiers import _crc

    monkeypatch.setattr(_crc, "CRC32C_BACKEND", "numpy")
    bench = load()
    assert bench.main(tiny(tmp_path)) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    header = [ln for ln in lines if ln.startswith("#")]
    assert header[1].startswith("# WARNING: CRC32C: numpy fallback (~50-100x slower"), header
    # The warning is a paragraph of its own (the method follows on a new `#` line).
    assert any(ln.endswith("pip install -e '.[tiers]'") for ln in header), header
    title = lines.index("the tiers against their medium (same bytes, same run)")
    assert lines[title + 1].startswith("WARNING: CRC32C: numpy fallback"), out
    rows = [ln for ln in lines if ln.startswith("disk (")]
    assert len(rows) == 2 and all(ln.endswith("n/a (numpy CRC32C)") for ln in rows), out
    assert "numpy fallback" in err  # also at the start, where --json users see it

    assert bench.main(tiny(tmp_path, "--json")) == 0
    doc = strict_json(capsys.readouterr().out)
    assert doc["crc32c_backend"] == "numpy" and doc["targets_apply"] is False
    assert "numpy fallback" in doc["warning"] and "numpy fallback" in doc["note"]
    assert [r["target_met"] for r in doc["rows"] if r["kind"] == "tier"] == [None, None]


@pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None,
    reason="needs redis-server and redis-benchmark",
)
def test_the_script_with_redis_prints_only_json_on_stdout(tmp_path):
    """The whole script, Redis part included (its own server on a free loopback port),
    tiny sizes: stdout parses as one JSON document; the server is gone afterwards."""
    argv = tiny(tmp_path, "--json")[1:]  # with Redis
    argv += ["--values", "2", "--value-kib", "64"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPT.parents[1]), *sys.path])}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    doc = strict_json(proc.stdout)
    assert [(r["tier"], r["op"]) for r in doc["rows"] if r["kind"] == "tier"][2:] == [
        ("redis", "store"),
        ("redis", "load"),
    ]


def test_cluster_arguments_parse():
    args = load().parse_args(["--no-disk", "--no-redis", "--cluster", "--clients"])
    assert args.cluster and args.clients and args.no_redis


@pytest.mark.skipif(
    not all(shutil.which(t) for t in ("redis-server", "redis-cli", "redis-benchmark")),
    reason="needs redis-server, redis-cli and redis-benchmark",
)
@pytest.mark.parametrize("primaries", [3, 1])
def test_the_cluster_get_baseline_moves_a_value_with_every_get(primaries):
    """redis-benchmark --cluster GETs `key:{TAG}:<n>` with one hash tag per node: the
    benchmark sets exactly those keys, so no GET of the baseline misses."""
    bench = load()._tiers_cluster
    cluster = bench.Cluster(primaries, 64 << 20)
    try:
        bench.fill_benchmark_keys(cluster, 20, 1024)
        assert sum(cluster.call(p, b"DBSIZE") for p in cluster.ports) == 20 * primaries
        misses = cluster.misses()
        bench.redis_benchmark("127.0.0.1", cluster.ports[0], "get", 1024, 60, 2 * primaries, 4,
                              keyspace=20, cluster=primaries > 1)  # fmt: skip
        assert cluster.misses() == misses
    finally:
        cluster.stop()
