"""The backend registry: one record per backend; the API offers only what the platform
runs (or interprets, when asked), and the configs refuse unusable fields."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "kernels.md"
NHD = pk.KVLayout.nhd()


@dataclasses.dataclass
class FakeDevice:
    """What ``supports`` reads from a jax device: platform, client, capability."""

    platform: str
    compute_capability: str | None = None
    client: object = None


def test_one_record_per_backend_name():
    names = [b.name for b in pk.list_backends()]
    assert ("auto", *names) == pk.BACKENDS
    assert {b.name: b.config for b in pk.list_backends()} == {
        "tpu": pk.TpuConfig,
        "mosaic_gpu": pk.MosaicGpuConfig,
        "triton": pk.TritonConfig,
        "xla": pk.XlaConfig,
        "reference": None,
    }
    for b in pk.list_backends():
        assert pk.get_backend(b.name) is b
        assert b.available == (b.name in pk.available_backends())


@pytest.mark.parametrize(
    ("where", "runs"),
    [
        ("cpu", {"xla", "reference"}),
        ("tpu", {"tpu", "xla", "reference"}),
        (FakeDevice("tpu"), {"tpu", "xla", "reference"}),
        (FakeDevice("gpu", "9.0"), {"mosaic_gpu", "triton", "xla", "reference"}),
        (FakeDevice("gpu", "10.0"), {"mosaic_gpu", "triton", "xla", "reference"}),
        (FakeDevice("gpu", "8.6"), {"triton", "xla", "reference"}),
        (FakeDevice("cpu"), {"xla", "reference"}),
    ],
    ids=["cpu", "tpu-name", "tpu", "h100", "b200", "a10", "cpu-device"],
)
def test_supports_follows_platform_and_capability(where, runs):
    importable = set(pk.available_backends())
    assert set(pk.supported_backends(where)) == runs & importable


def test_rocm_gpus_get_xla_only():
    rocm = FakeDevice("gpu", client=type("C", (), {"platform_version": "rocm 6.2"})())
    assert pk.supported_backends(rocm) == ("xla", "reference")


def test_interpreters_are_offered_when_asked():
    cpu = pk.supported_backends("cpu", interpret=True)
    assert {"xla", "reference"} <= set(cpu)
    for name in ("tpu", "triton", "mosaic_gpu"):
        assert (name in cpu) == pk.get_backend(name).can_interpret()


@pytest.mark.parametrize("backend", ["tpu", "triton", "mosaic_gpu"])
def test_pallas_backend_on_cpu_says_what_runs(backend):
    """Issue 13: this was jax's raw ValueError ("Only interpret mode is supported")."""
    cache = jnp.zeros((8, 4, 1, 8), jnp.bfloat16)
    ids = np.array([1], np.int32)
    with pytest.raises(pk.BackendUnavailableError) as info:
        pk.gather_blocks([cache], ids, layout=NHD, backend=backend)
    text = str(info.value)
    assert f"backend={backend!r} compiles only for" in text
    assert "('xla', 'reference')" in text and "on cpu" in text
    if pk.get_backend(backend).can_interpret():
        assert "interpret=True" in text
    staging = jnp.zeros((1, 1, 4, 1, 8), jnp.bfloat16)
    with pytest.raises(pk.BackendUnavailableError, match="compiles only for"):
        pk.scatter_blocks([cache], ids, staging, layout=NHD, backend=backend)


@pytest.mark.parametrize("backend", ["tpu", "triton", "mosaic_gpu"])
def test_interpret_true_runs_them_on_cpu(backend):
    if not pk.get_backend(backend).can_interpret():
        pytest.skip(f"this jax has no interpreter for {backend}")
    cache = jnp.arange(8 * 4 * 8, dtype=jnp.uint16).reshape(8, 4, 1, 8)
    ids = np.array([7, 0], np.int32)
    staged = pk.gather_blocks([cache], ids, layout=NHD, backend=backend, interpret=True)
    np.testing.assert_array_equal(np.asarray(staged)[:, 0], np.asarray(cache)[ids])


@pytest.mark.parametrize(
    ("device", "picked"),
    [
        (jax.devices("cpu")[0], "xla"),
        (FakeDevice("tpu"), "tpu"),
        (FakeDevice("gpu", "9.0"), "mosaic_gpu"),
        (FakeDevice("gpu", "8.0"), "triton"),
    ],
    ids=["cpu", "tpu", "h100", "a100"],
)
def test_auto_takes_the_first_record_that_runs_there(device, picked):
    from pallas_kernels.blocks.backends import pick_backend

    if picked not in pk.available_backends():
        pytest.skip(f"{picked} did not import on this jax")
    assert pick_backend(device).name == picked


def test_interpret_params_must_fit_the_backend():
    cache = jnp.zeros((8, 4, 1, 8), jnp.bfloat16)
    ids = np.array([1], np.int32)
    tpu = pk.get_backend("tpu")
    if not tpu.can_interpret():
        pytest.skip("no TPU interpreter")
    with pytest.raises(TypeError, match=r"interpret for backend='triton' must be a bool"):
        pk.gather_blocks(
            [cache], ids, layout=NHD, backend="triton", interpret=tpu.interpret_params()
        )
    # xla ignores an interpreter params object (the engine forwards one to "auto").
    pk.gather_blocks([cache], ids, layout=NHD, backend="xla", interpret=tpu.interpret_params())


# (config class, field, bad value, error type, text in the message)
BAD_FIELDS = [
    (pk.TpuConfig, "lanes", 0, pk.BackendConfigError, "TpuConfig.lanes=0 must be >= 1"),
    (pk.TpuConfig, "programs", -2, pk.BackendConfigError, "use e.g. programs=1"),
    (pk.TpuConfig, "blocks_in_flight", 0, pk.BackendConfigError, "blocks_in_flight=64"),
    (pk.TpuConfig, "programs", "2", TypeError, "TpuConfig.programs must be an int"),
    (pk.TpuConfig, "lanes", True, TypeError, "got bool"),
    (pk.TpuConfig, "lanes", 128.0, TypeError, "got float"),
    (pk.TritonConfig, "num_warps", 3, pk.BackendConfigError, "power of two <= 32"),
    (pk.TritonConfig, "num_warps", 64, pk.BackendConfigError, "power of two <= 32"),
    (pk.TritonConfig, "max_chunk_words", 0, pk.BackendConfigError, "max_chunk_words=4096"),
    (pk.TritonConfig, "blocks_per_program", 0, pk.BackendConfigError, ">= 1"),
    (pk.MosaicGpuConfig, "stages", 0, pk.BackendConfigError, "stages=4"),
    (pk.MosaicGpuConfig, "programs", 0, pk.BackendConfigError, "programs"),
    (pk.MosaicGpuConfig, "smem_budget_bytes", 0, pk.BackendConfigError, "smem_budget_bytes"),
    (pk.XlaConfig, "word_bytes", 3, pk.BackendConfigError, "must be 1, 2 or 4"),
    (pk.XlaConfig, "word_bytes", 8, pk.BackendConfigError, "must be 1, 2 or 4"),
    (pk.TpuConfig, "word_bytes", "4", TypeError, "word_bytes must be an int or None"),
]


@pytest.mark.parametrize(("cls", "field", "value", "kind", "text"), BAD_FIELDS)
def test_configs_refuse_unusable_fields(cls, field, value, kind, text):
    with pytest.raises(kind, match=re.escape(text)):
        cls(**{field: value})


def test_configs_take_numpy_ints_as_ints():
    config = pk.TpuConfig(programs=np.int64(2), lanes=np.int32(128))
    assert type(config.programs) is int and config == pk.TpuConfig(programs=2)
    assert hash(config) == hash(pk.TpuConfig(programs=2))
    assert pk.MosaicGpuConfig(programs=None).programs is None


def _docs_table(heading: str) -> list[list[str]]:
    text = DOCS.read_text()
    section = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_docs_backend_table_is_the_registry():
    """docs/kernels.md lists every backend, in registry order, with its `where`."""
    rows = _docs_table("Backends")
    assert [r[0].strip("`") for r in rows] == [b.name for b in pk.list_backends()]
    for row, record in zip(rows, pk.list_backends(), strict=True):
        assert row[1] == record.where, (row[1], record.where)
