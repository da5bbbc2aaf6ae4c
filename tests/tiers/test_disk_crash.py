"""A writer killed with SIGKILL in the middle of its stores, then a restart: every entry
read back is exactly what was stored, every store reported done is there, and the dead
writer's temporary files are cleaned up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jax_kvoffload.tiers import DiskTier, DiskTierConfig
from jax_kvoffload.tiers._disk_fs import process_token

from ._helpers import child_env, key, payload

NS = bytes(range(32))
SIZE = 64 * 1024

WRITER = """
import sys
from tests.tiers._helpers import key, payload
from jax_kvoffload.tiers import DiskTier, DiskTierConfig
path, fsync, size = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
tier = DiskTier(DiskTierConfig(path=path, capacity_bytes=1 << 34, write_threads=4,
                               max_pending_store_bytes=1 << 30, fsync=fsync), bytes(range(32)))
pending = []
for i in range(100000):
    pending.append((i, tier.submit_store([(key(i), payload(key(i), size))])))
    while len(pending) > 8 or (pending and pending[0][1].done()):
        j, f = pending.pop(0)
        if f.result().all_ok:
            print(j, flush=True)
"""


@pytest.mark.parametrize("fsync", [True, False])
def test_sigkill_during_writes_then_restart_has_zero_wrong_bytes(tmp_path, fsync):
    path = str(tmp_path / "tier")
    root = child_env()["PYTHONPATH"].split(os.pathsep)[0]
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, path, "1" if fsync else "0", str(SIZE)],
        env=child_env(),
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    done: list[int] = []
    deadline = time.monotonic() + 60
    try:
        while len(done) < 40 and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            done.append(int(line))
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        err = child.stderr.read()
        child.stderr.close()
    assert len(done) >= 40, err
    attempted = max(done) + 16  # everything it may have been writing when it died

    tier = DiskTier(DiskTierConfig(path=path, capacity_bytes=1 << 34), NS)
    try:
        assert tier.wait_rescan(30)
        leftovers = [f for _, _, fs in os.walk(path) for f in fs if f.endswith(".tmp")]
        assert leftovers == []  # the dead writer's temporary files are gone
        ids = list(range(attempted))
        outs = [np.zeros(SIZE, np.uint8) for _ in ids]
        r = tier.submit_load([(key(i), o) for i, o in zip(ids, outs)]).result(60)
        for i, o, ok in zip(ids, outs, r.ok):
            if ok:
                np.testing.assert_array_equal(o, payload(key(i), SIZE))
        hits = {i for i, ok in zip(ids, r.ok) if ok}
        assert set(done) <= hits  # a store reported done survives the process's death
        assert tier.stats().corrupt == 0
    finally:
        tier.close()


def test_a_crash_between_write_and_rename_leaves_a_miss(tmp_path):
    path = str(tmp_path / "tier")
    tier = DiskTier(DiskTierConfig(path=path, capacity_bytes=1 << 30), NS)
    tier.submit_store([(key(1), payload(key(1), SIZE))]).result()
    tier.close()
    # A temporary file of a writer that died (pid 2**22 + 1 does not exist), complete.
    final = next(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".kv"))
    leaf, name = os.path.split(final)
    dead = os.path.join(leaf, f".{name.replace('.kv', 'x.kv')}.{2**22 + 1}-0badc0de.1.1.tmp")
    with open(dead, "wb") as f:
        f.write(b"\0" * 100)
    mine = os.path.join(leaf, f".{name}.{os.getpid()}-{process_token()}.1.1.tmp")  # live: kept
    with open(mine, "wb") as f:
        f.write(b"\0" * 100)
    tier = DiskTier(DiskTierConfig(path=path, capacity_bytes=1 << 30), NS)
    try:
        assert tier.wait_rescan(10)
        assert not os.path.exists(dead) and os.path.exists(mine)
        assert tier.stats().entries == 1
    finally:
        tier.close()
        os.unlink(mine)
