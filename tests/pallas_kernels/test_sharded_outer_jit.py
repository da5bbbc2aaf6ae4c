"""gather_blocks inside an outer ``jax.jit`` that closes over caches split over a mesh.

jax embeds the closed-over caches as bf16 constants of the outer program; the
partitioner then slices those constants per device as floats, and XLA:CPU quiets their
NaN payloads (0x7F81 -> 0x7FC0) before any bitcast of the library runs. Caches passed
as arguments (tracers) take the global path and keep every bit. Runs in a subprocess
(it needs 4 simulated CPU devices).
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
    from tests.pallas_kernels.bitmodel import DTYPES, SPECIAL, bits_of, model_gather

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    special = np.array(SPECIAL["bf16"], np.uint16)
    bits = [np.resize(np.roll(special, k), (4, 2, 4, 2)) for k in range(2)]
    spec = {"heads": P(None, None, "model"), "both": P("data", None, "model")}[sys.argv[1]]
    caches = [jax.device_put(b.view(DTYPES["bf16"]), NamedSharding(mesh, spec)) for b in bits]
    ids = np.array([3, 0, 3], np.int32)
    layout = pk.KVLayout.nhd()
    got = jax.jit(lambda i: pk.gather_blocks(caches, i, layout=layout, backend="xla"))(ids)
    bad = bits_of(got) != model_gather(bits, ids, 0)
    print("OK" if not bad.any() else f"{int(bad.sum())} elements changed")
    """
)


@pytest.mark.parametrize(
    "where",
    [
        pytest.param(
            w,
            marks=pytest.mark.xfail(
                strict=True,
                reason="closed-over sharded bf16 caches are sliced as float constants by "
                "the partitioner, before the library sees them (NaN payloads quieted)",
            ),
        )
        for w in ("heads", "both")
    ],
)
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
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("OK"), done.stdout[-2000:]
