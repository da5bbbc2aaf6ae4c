"""`KVOffloader` with a Mooncake tier in `secondary_tiers`: an engine's prefix cascades
into a private Mooncake Store and another engine is served from it byte for byte, its
host pool registered with Mooncake once (the rows move from and into it, no copy)."""

from __future__ import annotations

import pytest

from jax_kvoffload.tiers import _mooncake_client as mc

from ._mooncake import NO_MOONCAKE, MooncakeStore
from .test_offloader_tiers import serve, store_prompt

pytestmark = pytest.mark.skipif(NO_MOONCAKE is not None, reason=str(NO_MOONCAKE))


def test_the_mooncake_tier_serves_another_engine_from_registered_pool_rows(monkeypatch):
    monkeypatch.setattr(mc, "REGISTER_MIN_BYTES", 1)  # the test's pool is small
    registered: list[tuple[int, int]] = []
    register = mc.Regions.register

    def spy(self, buf):
        before = dict(self._regions)
        ok = register(self, buf)
        registered.extend((a, n) for k, (_, a, n) in self._regions.items() if k not in before)
        return ok

    monkeypatch.setattr(mc.Regions, "register", spy)
    store = MooncakeStore()
    try:
        tiers = [{"type": "mooncake", **store.options(), "key_prefix": "jkv-offloader"}]
        hs = store_prompt(tiers, prompt="m")
        assert len(registered) == 1, registered  # the pool's rows: one exporter, once
        n, stats = serve(tiers, hs)
        assert n == 8 and stats[0].promoted == 4 and stats[0].medium == "remote"
        assert len(registered) == 2  # the second engine's pool, once
    finally:
        store.stop()
