"""Every directory and file the disk tier makes has exactly its mode (0700, 0600),
whatever the process umask: the namespace, its shards, the entries and
`namespace.json`, not only the tier's root and the parents above it.

Before: only the root and its parents were given their mode back; under a umask that
takes owner bits (`umask 0277`, `umask 0777`) the shards were made 0500 or 0000 and the
entries 0400 or 0000, so a non-root user's own tier could not write its shards or read
its entries (root, which these tests may run as, does not notice: the modes are checked).
"""

from __future__ import annotations

import os
import stat

import pytest

from jax_kvoffload.tiers import DiskTier, DiskTierConfig
from tests.tiers._helpers import key, payload

NS = bytes(range(32))


@pytest.mark.parametrize("umask", [0o277, 0o777, 0o000, 0o077])
def test_every_directory_and_file_the_tier_makes_has_its_exact_mode(tmp_path, umask):
    root = tmp_path / "a" / "tier"
    old = os.umask(umask)
    try:
        tier = DiskTier(
            DiskTierConfig(path=str(root), capacity_bytes=1 << 24), NS, describe={"m": 1}
        )
        with tier:
            assert tier.submit_store([(key(1), payload(key(1), 4096))]).result(30).all_ok
    finally:
        os.umask(old)
    wrong = []
    for where, dirs, files in os.walk(tmp_path / "a"):
        for name in dirs:
            mode = stat.S_IMODE(os.lstat(os.path.join(where, name)).st_mode)
            wrong += [(name, oct(mode))] if mode != 0o700 else []
        for name in files:
            mode = stat.S_IMODE(os.lstat(os.path.join(where, name)).st_mode)
            wrong += [(name, oct(mode))] if mode != 0o600 else []
    assert not wrong, wrong[:6]
    assert any(f.endswith(".kv") for _, _, fs in os.walk(root) for f in fs)
