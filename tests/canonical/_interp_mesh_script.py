"""Run in a subprocess with 8 simulated CPU devices (see test_rpa_canonical.py):

    python -m tests.canonical._interp_mesh_script BACKEND [BACKEND ...]

`KVOffloader` with each backend in interpret mode (issue 21, item 3) on global caches
of nothing but -0.0, NaN payloads and subnormals (fp16, bf16, fp32), KV heads sharded:
a prefix stored on 2 devices loads on 4, then on 1, bit for bit, and every block not
loaded keeps its bytes. NHD caches and RPA caches (canonical pages) both. Prints "ok".
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from jax_kvoffload import GroupCaches, KVOffloader
from tests.canonical.rpa_common import LAYERS, NB, as_bits, hashes, rpa_config
from tests.pallas_kernels.bitmodel import DTYPES, SPECIAL

HEADS = 4


def special(dtype: str, shape, roll: int) -> np.ndarray:
    u = np.dtype(f"u{np.dtype(DTYPES[dtype]).itemsize}")
    return np.resize(np.roll(np.array(SPECIAL[dtype], u), roll), shape).view(DTYPES[dtype])


def put(arrays, n: int, axis: int):
    mesh = Mesh(np.array(jax.devices()[:n]), ("model",))
    spec = [None] * arrays[0].ndim
    spec[axis] = "model"
    return [jax.device_put(a, NamedSharding(mesh, P(*spec))) for a in arrays]


def run(backend: str, dtype: str, layout: str) -> None:
    if layout == "rpa":
        shape, axis = pk.rpa_cache_shape(NB, 4, HEADS, 64, DTYPES[dtype]), 2
    else:
        # K|V packed on the last axis: 2 x the config's head size (the caches must state
        # what the config does: offloader/_cache_checks.py)
        shape, axis = (NB, 4, HEADS, 2 * 64), 2
    cfg = rpa_config(dtype, HEADS, canonical=True, extra={"cache_layout": layout})
    src = [special(dtype, shape, k) for k in range(LAYERS)]
    h = hashes(f"{backend}{dtype}{layout}", 2)
    kw = {"backend": backend, "interpret": backend not in ("xla", "reference")}
    caches = GroupCaches(put(src, 2, axis), layout)
    with KVOffloader(cfg, caches, total_kv_heads=HEADS, **kw) as off:
        assert off.wait([off.store(h, [1, 2])])[0].success
        for n in (4, 1):
            target = [special(dtype, shape, 3 + k) for k in range(LAYERS)]
            off.set_caches(put(target, n, axis))
            assert off.wait([off.load(h, [5, 0])])[0].success
            for got, s, t in zip(off.caches(), src, target, strict=True):
                g, s, t = as_bits(got), as_bits(s), as_bits(t)
                where = f"{backend} {dtype} {layout} 2->{n}"
                assert np.array_equal(g[[5, 0]], s[[1, 2]]), f"{where}: loaded blocks"
                keep = [b for b in range(NB) if b not in (5, 0)]
                assert np.array_equal(g[keep], t[keep]), f"{where}: other blocks"


def main():
    for backend in sys.argv[1:]:
        for dtype in ("fp16", "bf16", "fp32"):
            for layout in ("nhd", "rpa"):
                run(backend, dtype, layout)
    print("ok")


if __name__ == "__main__":
    main()
