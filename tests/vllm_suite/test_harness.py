"""The harness around vLLM's own tests: the sdist fetcher and the manifest (no vLLM needed)."""

from __future__ import annotations

import hashlib
import io
import tarfile

import pytest

from . import fetch_vllm_tests as fetch
from . import vllm_suite_manifest as manifest
from . import vllm_suite_soundness as soundness

SHA = "ab" * 32


def _index(*hrefs: str) -> str:
    links = "".join(f'<a href="{h}">{h.rsplit("/", 1)[-1]}</a><br/>' for h in hrefs)
    return f"<html><body>{links}</body></html>"


def test_sdist_url_picks_the_sdist_and_its_digest():
    page = _index(
        f"https://files.example/p/vllm-0.33.0-cp38-abi3-manylinux.whl#sha256={'cd' * 32}",
        f"https://files.example/p/vllm-0.33.0.tar.gz#sha256={SHA}",
        f"https://files.example/p/vllm-0.33.1.tar.gz#sha256={'ef' * 32}",
    )
    assert fetch.sdist_url(page) == ("https://files.example/p/vllm-0.33.0.tar.gz", SHA)


def test_sdist_url_resolves_relative_links():
    page = _index(f"../../packages/x/vllm-0.33.0.tar.gz#sha256={SHA}")
    url, _ = fetch.sdist_url(page, "https://pypi.org/simple/vllm/")
    assert url == "https://pypi.org/packages/x/vllm-0.33.0.tar.gz"


@pytest.mark.parametrize(
    "page, message",
    [
        (_index(f"https://f/vllm-0.32.0.tar.gz#sha256={SHA}"), "lists no vllm-0.33.0.tar.gz"),
        (_index("https://f/vllm-0.33.0.tar.gz"), "without a sha256"),
        (_index("https://f/vllm-0.33.0.tar.gz#md5=00"), "without a sha256"),
    ],
)
def test_sdist_url_refuses_what_it_cannot_verify(page, message):
    with pytest.raises(ValueError, match=message):
        fetch.sdist_url(page)


def test_check_digest_refuses_other_bytes():
    with pytest.raises(ValueError, match="is not the pinned"):
        fetch.check_digest(b"not the sdist")


def _sdist(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_extract_takes_only_the_offloading_tests(tmp_path):
    prefix = "vllm-0.33.0/tests/"
    data = _sdist(
        {
            prefix + "__init__.py": b"",
            prefix + "conftest.py": b"import heavy",  # vLLM's serving-stack conftest
            prefix + "v1/kv_offload/cpu/test_manager.py": b"# manager",
            prefix + "v1/kv_connector/unit/utils.py": b"# helpers",
            prefix + "v1/kv_connector/unit/test_nixl_connector.py": b"# other connector",
            prefix + "v1/kv_offload/../../../escape.py": b"# traversal",
            "vllm-0.33.0/vllm/__init__.py": b"",
        }
    )
    dest = tmp_path / "out"
    assert fetch.extract(data, dest) == 3
    got = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert got == [
        "SHA256",
        "tests/__init__.py",
        "tests/v1/kv_connector/unit/utils.py",
        "tests/v1/kv_offload/cpu/test_manager.py",
    ]
    assert not (tmp_path / "escape.py").exists()


def test_main_refuses_a_tarball_with_another_digest(tmp_path, capsys):
    tarball = tmp_path / "vllm-0.33.0.tar.gz"
    tarball.write_bytes(_sdist({"vllm-0.33.0/tests/__init__.py": b""}))
    assert hashlib.sha256(tarball.read_bytes()).hexdigest() != fetch.SDIST_SHA256
    assert fetch.main(["--tarball", str(tarball), "--dest", str(tmp_path / "d")]) == 1
    assert "is not the pinned" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_manifest_is_well_formed():
    m = manifest.load()
    assert m.files and m.entries
    seen: dict[str, str] = {}
    for entry in m.entries:
        assert entry.kind in manifest.KINDS
        assert len(entry.reason) > 40, entry.reason  # says what differs and where
        if entry.kind != "environment":
            assert entry.match, f"{entry.tests[0]}: an xfail entry needs `match`"
        for test in entry.tests:
            assert test.startswith("tests/v1/"), test
            assert test.split("::")[0] in {f.split("::")[0] for f in m.files}, (
                f"{test}: its file is not run"
            )
            assert test not in seen, f"{test} is listed twice"
            seen[test] = entry.kind
    for path, why in m.excluded.items():
        assert path.startswith("tests/v1/") and len(why) > 20, (path, why)


def test_entry_patterns_match_parametrized_ids_literally():
    entry = manifest.Entry(
        tests=["tests/v1/a.py::test_x[2-rocm]", "tests/v1/b.py::TestC::*"],
        kind="design",
        reason="an example reason that is long enough to pass",
        match="x",
    )
    assert entry.matches("tests/v1/a.py::test_x[2-rocm]")
    assert not entry.matches("tests/v1/a.py::test_x2")  # brackets are not a class
    assert entry.matches("tests/v1/b.py::TestC::test_y[1]")
    assert not entry.matches("tests/v1/b.py::TestD::test_y")
    with pytest.raises(ValueError, match="kind='other'"):
        manifest.Entry(tests=["t"], kind="other", reason="r")


@pytest.mark.parametrize("missing", ["torch", "vllm", "einops"])
def test_the_suite_says_what_is_missing(monkeypatch, missing):
    import importlib.machinery
    import importlib.util

    from . import test_vllm_suite as suite

    # Only `missing` is absent: the others are found, whatever this machine has (the
    # README's own test run has neither torch nor vLLM).
    present = importlib.machinery.ModuleSpec("present", None)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == missing else present
    )
    assert suite._unavailable() == f"{missing} is not installed (vLLM's offloading tests need it)"


def test_the_suite_says_where_the_sources_belong(monkeypatch, tmp_path):
    import importlib.metadata
    import importlib.util

    from . import test_vllm_suite as suite

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.33.0")
    monkeypatch.setattr(suite, "SOURCE", tmp_path)
    assert "fetch_vllm_tests.py" in suite._unavailable()
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.34.0")
    assert "vLLM 0.34.0 is installed" in suite._unavailable()


def test_only_vllms_test_files_may_keep_a_substitute_under_a_vllm_name():
    import types

    class Ours:  # stands for our spec, swapped in for vLLM's CPUOffloadingSpec
        pass

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    modules = {
        # vLLM's tests bind ours on purpose; so does the plugin itself.
        "tests.v1.kv_offload.test_factory": module("t", CPUOffloadingSpec=Ours),
        "vllm_substitution": module("p", CPUOffloadingSpec=Ours),
        # Our code under its own name: fine. Under vLLM's name: it took the substitute.
        "jax_kvoffload.bridge.vllm": module("o", JaxOffloadingSpec=Ours),
        "jax_kvoffload.bridge._vllm_metrics": module("m", CPUOffloadingSpec=Ours),
        # Any vLLM module holding ours, under any name, would test ours against ours.
        "vllm.v1.kv_offload.tiering.spec": module("v", Base=Ours),
        "vllm.v1.kv_offload.cpu.spec": module("s", CPUOffloadingSpec=object),
        "vllm.connector": module("c", CPUOffloadingSpec=Ours),  # swapped on purpose
        "gone": None,
    }
    found = soundness.unsound_bindings(
        modules, {"CPUOffloadingSpec": Ours}, allowed=("vllm.connector.CPUOffloadingSpec",)
    )
    assert found == [
        "jax_kvoffload.bridge._vllm_metrics.CPUOffloadingSpec",
        "vllm.v1.kv_offload.tiering.spec.Base",
    ]
