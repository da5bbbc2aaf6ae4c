"""TransferEngine on caches sharded over a device mesh (simulated CPU devices).

Runs in a subprocess: the device count must be set before jax initialises, and the rest
of the suite already initialised it with one device.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import pallas_kernels as pk
    from jax_kvoffload.hostmem import HostChunkPool
    from jax_kvoffload.transfer import GroupCaches, GroupTransfer, TransferEngine

    assert len(jax.devices()) == 4
    mesh = Mesh(np.array(jax.devices()), ("tp",))
    rng = np.random.default_rng(0)
    # bf16 bit patterns including NaN payloads that a float copy would canonicalise.
    bits = rng.integers(0, 2**16, (8, 4, 8, 16), dtype=np.uint16)
    bits[2, 0, 0, :] = 0x7F81
    heads = NamedSharding(mesh, P(None, None, "tp", None))  # [blocks, tokens, heads, dim]
    arrays = [jax.device_put(np.roll(bits, k).view(jnp.bfloat16), heads) for k in range(2)]
    before = [np.asarray(a).view(np.uint16).copy() for a in arrays]
    gc = GroupCaches(arrays, pk.KVLayout.nhd())
    # Each device gathers its own heads: the staging is sharded like the heads.
    staging = pk.staging_sharding(arrays, gc.layout)
    assert staging.spec == P(None, None, None, "tp", None), staging
    got = pk.gather_blocks(arrays, np.array([2, 5], np.int32), layout=gc.layout, backend="xla")
    assert got.sharding.is_equivalent_to(staging, 5), got.sharding
    np.testing.assert_array_equal(np.asarray(got[:, 1]).view(np.uint16), before[1][[2, 5]])
    # Sharded along the block axis instead: each device gathers the blocks it owns, and
    # the staging comes out whole on every device (its page axes are not split).
    by_block = [jax.device_put(a, NamedSharding(mesh, P("tp"))) for a in arrays]
    whole = pk.staging_sharding(by_block, gc.layout)
    assert whole is not None and whole.is_fully_replicated, whole
    got = pk.gather_blocks(by_block, np.array([2, 5], np.int32), layout=gc.layout, backend="xla")
    assert got.sharding.is_equivalent_to(whole, 5), got.sharding
    np.testing.assert_array_equal(np.asarray(got[:, 0]).view(np.uint16), before[0][[2, 5]])
    # FIRST stacking ([2, blocks, ...]) sharded along its K/V axis: the global path too.
    first = pk.KVLayout.nhd(pk.KVStacking.FIRST)
    kv = np.stack([before[0], before[1]])  # [2, 8, 4, 8, 16]
    kv_mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    by_kv = jax.device_put(kv, NamedSharding(kv_mesh, P("x")))
    assert pk.staging_sharding([by_kv], first) is None
    got = pk.gather_blocks([by_kv], np.array([1, 6], np.int32), layout=first, backend="xla")
    np.testing.assert_array_equal(np.asarray(got)[:, 0], kv[:, [1, 6]].swapaxes(0, 1))
    pool = HostChunkPool(4, {0: gc.block_bytes}, 2)
    with TransferEngine({0: gc}, pool, backend="xla") as engine:
        engine.submit_store(1, [GroupTransfer(0, (2, 5, 7), (3, 0))])
        assert engine.wait([1])[0].success
        def ptrs():
            shards = engine.arrays(0)[0].addressable_shards
            return [s.data.unsafe_buffer_pointer() for s in shards]

        before_ptrs = ptrs()
        engine.submit_load(2, [GroupTransfer(0, (0, 1, 3), (3, 0))])
        (load,) = engine.wait([2])
        assert load.success, load.error
        after = [np.asarray(a).view(np.uint16) for a in engine.arrays(0)]
        assert engine.arrays(0)[0].sharding.is_equivalent_to(heads, 4), engine.arrays(0)[0].sharding
        assert ptrs() == before_ptrs  # the scatter wrote in place, shard by shard
    for layer in range(2):
        np.testing.assert_array_equal(after[layer][[0, 1, 3]], before[layer][[2, 5, 7]])
        np.testing.assert_array_equal(after[layer][[2, 4, 5, 6, 7]], before[layer][[2, 4, 5, 6, 7]])
    print("OK")
    """
)


def test_store_and_load_on_head_sharded_caches_are_bit_exact():
    _run(SCRIPT)


ATTENTION_DP = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import pallas_kernels as pk
    from jax_kvoffload.hostmem import HostChunkPool
    from jax_kvoffload.transfer import GroupCaches, GroupTransfer, TransferEngine

    # tpu-inference's attention-DP meshes: blocks over data, KV heads over tp.
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "tp"))
    split = NamedSharding(mesh, P("data", None, "tp", None))
    bits = np.random.default_rng(1).integers(0, 2**16, (8, 4, 8, 16), dtype=np.uint16)
    bits[2, 0, 0, :], bits[5, 1, 3, :], bits[7, 2, 5, :] = 0x7F81, 0x807F, 0x8000
    arrays = [jax.device_put(np.roll(bits, k).view(jnp.bfloat16), split) for k in range(2)]
    before = [np.asarray(a).view(np.uint16).copy() for a in arrays]
    pool = HostChunkPool(4, {0: GroupCaches(arrays, "nhd").block_bytes}, 2)
    with TransferEngine({0: GroupCaches(arrays, "nhd")}, pool, backend="xla") as engine:
        engine.submit_store(1, [GroupTransfer(0, (2, 5, 7), (3, 0))])  # both data halves
        assert engine.wait([1])[0].success

        def ptrs():
            return [s.data.unsafe_buffer_pointer() for s in engine.arrays(0)[0].addressable_shards]

        from jax_kvoffload.transfer import _copies

        job = 2
        # Every way a load's piece reaches the devices: shard by shard (pieces above
        # WHOLE_PIECE_BYTES) or from one host buffer, on the load thread or inline (then
        # its host staging and numpy ids go straight into the scatter's jit).
        for whole in (0, 1 << 20):
            for inline in (False, True):
                _copies.WHOLE_PIECE_BYTES = whole
                engine.set_arrays(0, [jax.device_put(b.view(jnp.bfloat16), split) for b in before])
                before_ptrs = ptrs()
                engine.submit_load(job, [GroupTransfer(0, (0, 6, 3), (3, 0))], inline=inline)
                (load,) = engine.wait([job])
                job += 1
                assert load.success, load.error
                after = [np.asarray(a).view(np.uint16) for a in engine.arrays(0)]
                got = engine.arrays(0)[0].sharding
                assert got.is_equivalent_to(split, 4), got
                assert ptrs() == before_ptrs  # in place, each device its own blocks
                for layer in range(2):
                    np.testing.assert_array_equal(after[layer][[0, 6, 3]], before[layer][[2, 5, 7]])
                    kept = [1, 2, 4, 5, 7]
                    np.testing.assert_array_equal(after[layer][kept], before[layer][kept])
    print("OK")
    """
)


def test_store_and_load_on_attention_dp_caches_are_bit_exact():
    _run(ATTENTION_DP)


def _run(script: str) -> None:
    """Runs a script above in its own process (it needs 4 simulated devices)."""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("OK")
