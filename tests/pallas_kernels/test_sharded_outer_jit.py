"""gather_blocks / scatter_blocks inside an outer ``jax.jit`` that closes over caches
split over a mesh.

jax embeds closed-over caches as constants of the outer program, and the partitioner
slices those per device; sliced as bf16, XLA:CPU quieted their NaN payloads (0x7F81 ->
0x7FC0) before any bitcast of the library ran. The API now hands such calls the caches'
integer bits. Runs in a subprocess (it needs 4 simulated CPU devices).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).parents[2]
SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import pallas_kernels as pk
    from tests.pallas_kernels.bitmodel import DTYPES, SPECIAL, bits_of, model_gather, model_scatter

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    special = np.array(SPECIAL["bf16"], np.uint16)
    bits = [np.resize(np.roll(special, k), (4, 2, 4, 2)) for k in range(2)]
    spec = {"heads": P(None, None, "model"), "both": P("data", None, "model")}[sys.argv[1]]
    bf16 = DTYPES["bf16"]
    caches = [jax.device_put(b.view(bf16), NamedSharding(mesh, spec)) for b in bits]
    kw = {"layout": pk.KVLayout.nhd(), "backend": "xla"}
    ids = np.array([3, 0, 3], np.int32)
    want = model_gather(bits, ids, 0)
    for name, got in (
        ("traced ids", jax.jit(lambda i: pk.gather_blocks(caches, i, **kw))(ids)),
        ("numpy ids", jax.jit(lambda: pk.gather_blocks(caches, ids, **kw))()),
    ):
        bad = bits_of(got) != want
        assert not bad.any(), f"gather, {name}: {int(bad.sum())} elements changed"
    update = np.resize(special[::-1], (2, 2, 2, 4, 2))
    at = np.array([1, 3], np.int32)
    want = model_scatter(bits, at, update, 0)
    out = jax.jit(lambda i, s: pk.scatter_blocks(caches, i, s, **kw))(at, update.view(bf16))
    for o, w in zip(out, want, strict=True):
        bad = bits_of(o) != w
        assert not bad.any(), f"scatter: {int(bad.sum())} elements changed"
    print("OK")
    """
)


@pytest.mark.parametrize("where", ["heads", "both"])
def test_outer_jit_closing_over_split_caches_keeps_bits(where):
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, where],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-1000:] + done.stderr[-3000:]
    assert done.stdout.strip().endswith("OK"), done.stdout[-2000:]
