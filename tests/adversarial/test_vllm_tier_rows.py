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


def test_an_entry_of_another_row_size_is_a_miss_and_is_kept(tmp_path):
    # An engine of another geometry writing the same namespace (e.g. the same served
    # model name over another model): its entry does not fit our row. The tier raises
    # TierBufferSizeError from the job; the manager reports a failed load and a miss
    # (before: the entry was removed as corrupt; raising would end vLLM's scheduler).
    import time

    import numpy as np

    tier = {"type": "JaxDiskTier", "module_path": BRIDGE, "path": str(tmp_path / "t"),
            "capacity_bytes": "1GiB"}  # fmt: skip
    spec = make_spec(tier, chunks=4)
    m = spec.get_manager()
    try:
        ours = m.secondary_tiers[0]
        key = make_offload_key(b"\x02" * 32, 0)
        row_bytes = rows(spec, m).shape[1]
        other = np.full(2 * row_bytes, 5, np.uint8)
        assert ours.tier.submit_store([(bytes(key), other)]).result(30).all_ok
        ours.submit_load(types.SimpleNamespace(job_id=7, keys=[key], chunk_ids=[1]))
        deadline, results = time.monotonic() + 30, []
        while not results and time.monotonic() < deadline:
            results = ours.get_finished_jobs()
            time.sleep(0.01)
        assert [(r.job_id, r.success) for r in results] == [(7, False)]
        assert ours.tier.contains([bytes(key)]) == [True]
        assert ours.tier.stats().corrupt == 0
    finally:
        m.shutdown()


def test_a_size_error_is_logged_once_per_tier_not_per_job(tmp_path, caplog):
    # Before: every load job that met another geometry's entry logged a WARNING with
    # the whole message: an engine sharing a namespace with one of another geometry
    # flooded the log once per scheduler step. Now: the first at WARNING, then DEBUG.
    import logging
    import time

    import numpy as np

    tier = {"type": "JaxDiskTier", "module_path": BRIDGE, "path": str(tmp_path / "t"),
            "capacity_bytes": "1GiB"}  # fmt: skip
    spec = make_spec(tier, chunks=4)
    m = spec.get_manager()
    try:
        ours = m.secondary_tiers[0]
        key = make_offload_key(b"\x03" * 32, 0)
        row_bytes = rows(spec, m).shape[1]
        other = np.full(2 * row_bytes, 5, np.uint8)
        assert ours.tier.submit_store([(bytes(key), other)]).result(30).all_ok
        caplog.set_level(logging.DEBUG, logger="jax_kvoffload.bridge")
        for job in range(10, 15):
            ours.submit_load(types.SimpleNamespace(job_id=job, keys=[key], chunk_ids=[1]))
            deadline, results = time.monotonic() + 30, []
            while not results and time.monotonic() < deadline:
                results = ours.get_finished_jobs()
                time.sleep(0.005)
            assert [(r.job_id, r.success) for r in results] == [(job, False)]
        sized = [r for r in caplog.records if "buffer has" in r.getMessage()]
        assert [r.levelno for r in sized] == [logging.WARNING] + [logging.DEBUG] * 4
    finally:
        m.shutdown()
