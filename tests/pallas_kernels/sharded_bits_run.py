"""Run by test_bits_sharded.py in a subprocess (it needs 8 simulated CPU devices):

    python sharded_bits_run.py SEED CASES BACKEND [BACKEND ...]
    python sharded_bits_run.py hazard BACKEND [BACKEND ...]

Random cases of the bit model (``bitmodel.py``) on caches sharded over meshes of 1-8
devices: every layout (RPA included), every dtype, special bit patterns (NaN payloads,
-0.0, subnormals), sharded along the page axes (KV heads, RPA slot rows, the MLA latent),
along the block axis, over two-axis meshes whose data axis has one device
(tpu-inference's ``P("data", None, "model")``) or two, and replicated. For every backend
named (interpreters run with ``interpret=True``), gather and scatter must equal the numpy
model bit for bit, a scatter must keep every page it does not name and each cache's
sharding. Prints "OK ..." and exits 0, or exits 1 naming the first failing case.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from tests.pallas_kernels.bitmodel import (
    DTYPES,
    LAYOUTS,
    SPECIAL,
    bits_of,
    model_gather,
    model_scatter,
    random_bits,
)

ALL = {**LAYOUTS, "rpa": pk.KVLayout.rpa()}
FLOATS = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2")
# Where each layout keeps its heads (the axis a TP mesh shards), in the full shape.
HEAD_AXIS = {"nhd": 2, "hnd": 1, "nhd_first": 3, "hnd_first": 2, "nhd_second": 3}
HEAD_AXIS |= {"hnd_second": 2, "nhd_separate": 2, "mla": 2, "raw": 1, "rpa": 2}
MESHES = [((1,), ("model",)), ((2,), ("model",)), ((4,), ("model",)), ((8,), ("model",))]
MESHES += [((1, 4), ("data", "model")), ((2, 4), ("data", "model")), ((2, 2), ("data", "model"))]


def _shape(layout: str, nb: int, bs: int, h: int, d: int, dtype: str) -> tuple[int, ...]:
    if layout == "rpa":  # h heads over the model axis: whole RPA rows per shard
        return (nb, bs, h, pk.rpa_packing(DTYPES[dtype]), 128)
    return {
        "nhd": (nb, bs, h, d),
        "hnd": (nb, h, bs, d),
        "nhd_first": (2, nb, bs, h, d),
        "hnd_first": (2, nb, h, bs, d),
        "nhd_second": (nb, 2, bs, h, d),
        "hnd_second": (nb, 2, h, bs, d),
        "nhd_separate": (nb, bs, h, d),
        "mla": (nb, bs, h * d),
        "raw": (nb, h * d),
    }[layout]


def draw(rng: np.random.Generator, backend: str) -> dict:
    interp = backend not in ("xla", "reference")
    layout = str(rng.choice(list(ALL)))
    dtype = str(rng.choice(("int8", "uint16") if layout == "raw" else (*FLOATS, "int8")))
    shape_m, names = MESHES[int(rng.integers(len(MESHES)))]
    size = {n: s for n, s in zip(names, shape_m, strict=True)}
    mesh = Mesh(np.array(jax.devices()[: int(np.prod(shape_m))]).reshape(shape_m), names)
    # "both": blocks over data, heads over model (tpu-inference's attention-DP meshes);
    # "blocks2": blocks over (data, model) together, a two-axis split of one axis.
    kinds = ("heads", "heads", "blocks", "replicated")
    if "data" in size:
        kinds += ("both", "blocks2")
    where = str(rng.choice(kinds))
    if ALL[layout].block_axis and where in ("both", "blocks2"):
        where = "blocks"  # FIRST stacking: the K/V axis before the blocks stays whole
    s_model = size["model"]
    nb = int(rng.integers(1, 4 if interp else 6))
    bs = int(rng.choice((1, 2, 4) if interp else (1, 2, 3, 16)))
    h = s_model * int(rng.choice((1, 2)))
    d = int(rng.choice((1, 2, 8)))
    if where in ("blocks", "both"):
        nb = size.get("data", s_model) * max(1, nb // 2)
    elif where == "blocks2":
        nb = size["data"] * s_model * max(1, nb // 2)
    shape = _shape(layout, nb, bs, h, d, dtype)
    spec: list = [None] * len(shape)
    block_axis = ALL[layout].block_axis
    if where == "heads":
        spec[HEAD_AXIS[layout]] = "model"
        if "data" in size and size["data"] == 1:
            spec[block_axis] = "data"  # tpu-inference's P("data", None, "model")
    elif where == "blocks":
        spec[block_axis] = "data" if "data" in size else "model"
    elif where == "both":
        spec[block_axis], spec[HEAD_AXIS[layout]] = "data", "model"
    elif where == "blocks2":
        spec[block_axis] = ("data", "model")
    num = int(rng.choice((2, 4) if layout == "nhd_separate" else (1, 2, 3)))
    return {
        "layout": layout,
        "dtype": dtype,
        "shape": shape,
        "mesh": mesh,
        "spec": P(*spec),
        "caches": [random_bits(rng, shape, dtype) for _ in range(num)],
        "gather": rng.integers(0, nb, size=int(rng.integers(1, 5))).astype(np.int32),
        "scatter": rng.permutation(nb)[: int(rng.integers(1, nb + 1))].astype(np.int32),
        "backend": backend,
        "host_staging": bool(rng.integers(2)),
        # The scatter through scatter_blocks, or a ScatterPlan with host or device ids.
        "via": str(rng.choice(("scatter_blocks", "plan", "plan_device_ids"))),
        # Split over several devices: must take the shard_map path (no resharding).
        "per_device": _split_over(spec, size) > 1,
    }


def _split_over(spec: list, size: dict) -> int:
    """How many distinct pieces the spec cuts an array into."""
    pieces = 1
    for entry in spec:
        for name in () if entry is None else entry if isinstance(entry, tuple) else (entry,):
            pieces *= size[name]
    return pieces


def describe(c: dict) -> str:
    mesh = dict(c["mesh"].shape)
    return (
        f"{c['backend']} {c['layout']} {c['dtype']} shape={c['shape']} mesh={mesh} "
        f"spec={c['spec']} L={len(c['caches'])} gather={c['gather'].tolist()} "
        f"scatter={c['scatter'].tolist()} via={c.get('via', 'scatter_blocks')}"
    )


def check(c: dict, rng: np.random.Generator) -> str | None:
    layout, dt = ALL[c["layout"]], DTYPES[c["dtype"]]
    sharding = NamedSharding(c["mesh"], c["spec"])
    kw: dict = {"layout": layout, "backend": c["backend"]}
    if c["backend"] not in ("xla", "reference"):
        kw["interpret"] = True
    axis = layout.block_axis

    def put():
        return [jax.device_put(b.view(dt), sharding) for b in c["caches"]]

    staged = pk.gather_blocks(put(), c["gather"], **kw)
    want = model_gather(c["caches"], c["gather"], axis)
    got = bits_of(staged)
    if got.shape != want.shape or not np.array_equal(got, want):
        bad = np.flatnonzero(got != want) if got.shape == want.shape else [0]
        i = bad[0]
        return f"gather changed {len(bad)} elements, first {want.flat[i]:#x} -> {got.flat[i]:#x}"
    caches = put()
    if c.get("per_device"):
        where = pk.staging_sharding(caches, layout)
        if where is None:
            return "a cache split over several devices took the global path (resharding)"
        compiled = c["backend"] in ("xla", "reference")
        if compiled and not staged.sharding.is_equivalent_to(where, staged.ndim):
            return f"gather's staging came back {staged.sharding}, not {where}"
    update = random_bits(rng, (len(c["scatter"]), len(caches), *want.shape[2:]), c["dtype"])
    if c.get("special_update"):  # -0.0 and NaN payloads only
        update = np.resize(c["caches"][0][::-1], update.shape)
    if c["host_staging"]:
        staging = update.view(dt)
    elif c.get("staging_spec") is not None:  # on the devices, sharded some other way
        staging = jax.device_put(update.view(dt), NamedSharding(c["mesh"], c["staging_spec"]))
    else:
        where = pk.staging_sharding(caches, layout) or NamedSharding(c["mesh"], P())
        staging = jax.device_put(update.view(dt), where)
    via = c.get("via", "scatter_blocks")
    if via == "scatter_blocks":
        out = pk.scatter_blocks(caches, c["scatter"], staging, **kw)
    else:
        plan = pk.plan_scatter(caches, **kw)
        ids = c["scatter"]
        if via == "plan_device_ids" and plan.ids_sharding is not None:
            ids = jax.device_put(ids, plan.ids_sharding)
        out = plan(caches, ids, staging)
    expected = model_scatter(c["caches"], c["scatter"], update, axis)
    for k, (o, e) in enumerate(zip(out, expected, strict=True)):
        ob = bits_of(o)
        if not np.array_equal(ob, e):
            i, wrong = np.flatnonzero(ob != e)[0], int((ob != e).sum())
            return f"scatter array {k}: {wrong} wrong, first {e.flat[i]:#x} -> {ob.flat[i]:#x}"
        if not o.sharding.is_equivalent_to(sharding, o.ndim):
            return f"scatter array {k} came back sharded {o.sharding}, not {sharding}"
    return None


def hazard_cases(backend: str) -> list[dict]:
    """Issue 21's class, by hand: caches of nothing but -0.0, NaN payloads and
    subnormals (fp16, bf16, fp32), KV heads sharded over 4 devices, the scatter's staging
    on the devices (where ``staging_sharding`` puts it, or sharded some other way) and on
    the host; and the same over block-sharded meshes. A staging sharded other than the
    per-device path wants was resharded as bf16 inside the jit (0x7F81 -> 0x7FC1)."""
    out = []
    for dtype in ("fp16", "bf16", "fp32"):
        special = np.array(SPECIAL[dtype], dtype=bits_of(np.zeros(1, DTYPES[dtype])).dtype)
        for spec, (names, sizes), misplaced in (
            (P(None, None, "model", None), (("model",), (4,)), P()),
            (P("data", None, "model", None), (("data", "model"), (1, 4)), P()),
            (P("model"), (("model",), (4,)), P(None, None, None, "model")),
            (P(None, None, "model", None), (("data", "model"), (2, 2)), P("data")),
            # attention DP: blocks over data, heads over model
            (P("data", None, "model", None), (("data", "model"), (2, 2)), P("data")),
            (
                P("data", None, "model", None),
                (("data", "model"), (2, 2)),
                P(None, None, None, "data"),
            ),
        ):
            mesh = Mesh(np.array(jax.devices()[:4]).reshape(sizes), names)
            shape = (4, 2, 4, 2)
            caches = [np.resize(np.roll(special, k), shape) for k in range(2)]
            for host, staging_spec in ((False, None), (True, None), (False, misplaced)):
                out.append({"layout": "nhd", "dtype": dtype, "shape": shape, "mesh": mesh,
                            "spec": spec, "caches": caches, "backend": backend,
                            "gather": np.array([3, 0, 3], np.int32),
                            "scatter": np.array([1, 3], np.int32), "host_staging": host,
                            "staging_spec": staging_spec, "special_update": True})  # fmt: skip
    return out


def run_hazards(backends: list[str]) -> int:
    rng = np.random.default_rng(1)
    for backend in backends:
        for c in hazard_cases(backend):
            err = check(c, rng)
            if err:
                at = "host" if c["host_staging"] else c["staging_spec"] or "staging_sharding"
                print(f"FAIL hazard: {describe(c)} staging at {at}: {err}")
                return 1
    print(f"OK hazard cases, backends {backends}")
    return 0


def main() -> int:
    if sys.argv[1] == "hazard":
        return run_hazards(sys.argv[2:])
    seed, cases, backends = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    done = 0
    for b, backend in enumerate(backends):
        rng = np.random.default_rng([seed, b])
        for k in range(cases):
            c = draw(rng, backend)
            err = check(c, rng)
            if err:
                print(f"FAIL case {k}: {describe(c)}: {err}; replay with seed {seed}")
                return 1
            done += 1
    print(f"OK {done} sharded cases, backends {backends}, seed {seed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
