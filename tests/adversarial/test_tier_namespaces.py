"""Engines that differ in anything their pages' bytes depend on never read each other's
tier entries, on one disk directory or one Redis server; engines that agree do.

A `KVOffloader`'s config says the model, dtype, tokens per block, blocks per chunk and
layers, but not how its caches lay a page out (NHD or HND, K and V apart or stacked)
nor the heads and head size behind a block's bytes: that is in the `GroupCaches` it is
handed. Both used to share one namespace, so an HND engine loaded an NHD engine's pages
as its own (every K/V value transposed, the load reported successful), and engines whose
rows differ in length removed each other's entries as corrupt."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jax_kvoffload import GroupCaches, KVOffloader
from jax_kvoffload.assembly import engine_pages
from jax_kvoffload.config import (
    CacheConfig,
    EngineConfig,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVTransferConfig,
    ModelConfig,
    build_offloading_config,
)
from jax_kvoffload.tiers import namespace_digest
from tests.faults._helpers import hashes
from tests.tiers._helpers import NO_REDIS, REDIS_SERVER, RedisServer

NB, BS, LAYERS = 16, 4, 2
LAYER_NAMES = [f"l{i}" for i in range(LAYERS)]
SEP, SECOND = pk.KVStacking.SEPARATE, pk.KVStacking.SECOND

# name -> (heads, head size, layout); every one has 2 * 16 uint16 words per token.
ENGINES = {
    "nhd": (2, 8, pk.KVLayout.nhd(SEP)),
    "hnd": (2, 8, pk.KVLayout.hnd(SEP)),
    "nhd stacked": (2, 8, pk.KVLayout.nhd(SECOND)),
    "4 heads of 4": (4, 4, pk.KVLayout.nhd(SEP)),
}


def config(heads: int, head_size: int, tiers: list) -> object:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=head_size,
                             dtype="uint16")  # fmt: skip
    return build_offloading_config(
        EngineConfig(
            model_config=ModelConfig(model="m", dtype="float16", total_num_kv_heads=heads),
            cache_config=CacheConfig(block_size=BS),
            kv_transfer_config=KVTransferConfig(
                kv_connector_extra_config={
                    "cpu_bytes_to_use": 1 << 20,
                    "blocks_per_chunk": 2,
                    "secondary_tiers": tiers,
                }
            ),
        ),
        KVCacheConfig(
            num_blocks=NB,
            kv_cache_tensors=(),
            kv_cache_groups=(KVCacheGroupSpec(layer_names=LAYER_NAMES, kv_cache_spec=spec),),
        ),
    )


def engine(name: str, tiers: list, seed: int) -> KVOffloader:
    heads, size, layout = ENGINES[name]
    page = (2, BS, heads, size) if layout.kv_stacking is SECOND else (BS, heads, size)
    if layout.page_format is pk.PageFormat.HND:
        page = (heads, BS, size)
    n = LAYERS if layout.kv_stacking is SECOND else 2 * LAYERS
    rng = np.random.default_rng(seed)
    arrays = [jnp.asarray(rng.integers(0, 2**16, (NB, *page), dtype=np.uint16)) for _ in range(n)]
    return KVOffloader(config(heads, size, tiers), GroupCaches(arrays, layout), backend="xla")


def rows(off: KVOffloader, ids: list[int]) -> list[np.ndarray]:
    return [np.asarray(a)[ids] for a in off.caches()]


def store_then_read(tiers: list, writer: str, reader: str) -> None:
    hs = hashes("ns", 4)
    a = engine(writer, tiers, seed=1)
    assert a.wait([a.store(hs, [0, 1, 2, 3])])[0].success
    written = rows(a, [0, 1, 2, 3])
    a.close()  # the cascades are in the tier
    b = engine(reader, tiers, seed=2)
    n = b.lookup(hs)
    if reader != writer:
        assert n == 0, f"a {reader!r} engine found a {writer!r} engine's pages"
    else:
        assert n == 4
        assert b.wait([b.load(hs, [8, 9, 10, 11])])[0].success
        for got, want in zip(rows(b, [8, 9, 10, 11]), written, strict=True):
            np.testing.assert_array_equal(got, want)
    b.close()
    # The reader removed nothing: the writer's kind still finds its entries.
    c = engine(writer, tiers, seed=3)
    assert c.lookup(hs) == 4, f"a {reader!r} engine removed a {writer!r} engine's entries"
    c.close()


@pytest.mark.parametrize("reader", sorted(ENGINES))
def test_engines_on_one_disk_directory_read_only_their_own_pages(tmp_path, reader):
    tiers = [{"type": "disk", "path": str(tmp_path / "tier"), "capacity_bytes": "16MiB"}]
    store_then_read(tiers, "nhd", reader)


@pytest.mark.skipif(REDIS_SERVER is None, reason=NO_REDIS)
def test_engines_on_one_redis_server_read_only_their_own_pages():
    server = RedisServer()
    try:
        tiers = [{"type": "redis", "url": server.url}]
        for reader in sorted(ENGINES):
            server.call(b"FLUSHALL")
            store_then_read(tiers, "hnd", reader)
    finally:
        server.stop()


def test_the_namespace_names_the_pages_and_the_offloader_says_it():
    layout = ENGINES["hnd"][2]
    off = engine("hnd", [], seed=0)
    cfg = off.config
    pages = engine_pages({0: GroupCaches(off.caches(), layout)})
    assert off.tier_namespace == namespace_digest(cfg, pages=pages) != namespace_digest(cfg)
    off.close()
