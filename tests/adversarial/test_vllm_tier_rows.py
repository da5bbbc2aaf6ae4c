"""Our tiers inside vLLM's tiering manager address vLLM's primary rows by chunk id. A
chunk id outside the rows used to slice the row view from its end (a negative id) or
short (past the end): the tier stored another row's bytes, with a valid checksum, under
the job's key, and served them later as that key's KV. Refused now, before any I/O."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33.0 is not installed")

from vllm.v1.kv_offload.base import make_offload_key

from jax_kvoffload.errors import KVOffloadValueError
from tests.tiers.test_vllm_tiers import BRIDGE, make_spec, rows

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("chunk", [-1, -2, 4, 2**40])
def test_a_chunk_id_outside_the_primary_rows_is_refused(tmp_path, chunk):
    tier = {"type": "JaxDiskTier", "module_path": BRIDGE, "path": str(tmp_path / "t"),
            "capacity_bytes": "1GiB"}  # fmt: skip
    spec = make_spec(tier, chunks=4)
    m = spec.get_manager()
    try:
        r = rows(spec, m)
        r[:] = 7  # every real row holds sevens
        del r
        ours = m.secondary_tiers[0]
        key = make_offload_key(b"\x01" * 32, 0)
        job = types.SimpleNamespace(job_id=1, keys=[key], chunk_ids=[chunk])
        with pytest.raises(KVOffloadValueError, match="chunk"):
            ours.submit_store(job)
        with pytest.raises(KVOffloadValueError, match="chunk"):
            ours.submit_load(job)
        assert ours.tier.contains([bytes(key)]) == [False]
    finally:
        m.shutdown()
