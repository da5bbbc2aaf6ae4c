"""The kernel-backend contract, run on one backend by name (CONTRIBUTING.md, "Adding a
kernel backend"): gather and scatter against the reference, bit for bit, on stacked and
unstacked layouts, on float dtypes whose bits XLA:CPU likes to change (bf16, fp8) and
integers, for no block, one block, and permuted non-contiguous ids including the last block; a
scatter writes the named pages and leaves every other page as it was.
"""

from __future__ import annotations

import jax.numpy as jnp

import pallas_kernels as pk

from .cases import LAYOUTS, Case, assert_same_bits, block_ids, make_caches, random_bits

__all__ = ["run_backend_contract"]

# layout, dtype, arrays, block size, head dim, n. Few: each is two compiles (~1 s each
# on the 2-core CI VM); the repository's own suites cover every layout x dtype.
CASES = [
    Case("nhd", "bf16", 2, 16, 64, 7),  # bf16: XLA:CPU changes its bits if moved as values
    Case("nhd_kv_first", "fp8_e4m3", 2, 16, 64, 1),
    Case("hnd", "fp32", 1, 16, 64, 0),
    Case("mla", "int8", 1, 16, 576, 7),
]


def run_backend_contract(backend: str, **kwargs: object) -> None:
    """Raises `AssertionError` where `backend` moves a bit the reference does not;
    `kwargs` go to both calls (e.g. `config=`, `interpret=True`)."""
    for case in CASES:
        layout, caches, ids = LAYOUTS[case.layout], make_caches(case), block_ids(case.n)
        staged = pk.gather_blocks(caches, ids, layout=layout, backend=backend, **kwargs)
        assert_same_bits(
            staged, pk.gather_blocks_reference(caches, jnp.asarray(ids), layout=layout)
        )
        update = random_bits(staged.shape, staged.dtype, seed=99)
        want = pk.scatter_blocks_reference(caches, jnp.asarray(ids), update, layout=layout)
        got = pk.scatter_blocks(caches, ids, update, layout=layout, backend=backend, **kwargs)
        for g, w in zip(got, want, strict=True):  # the named pages, and no other
            assert_same_bits(g, w)
