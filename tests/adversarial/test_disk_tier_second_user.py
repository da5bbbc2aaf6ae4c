"""The disk tier against a second local user (uid 65534; tests run as root here, skipped
otherwise) in a shared, world-writable parent directory such as /tmp: a directory or a
link planted where the tier will live is refused, and the victim's entries can be
neither listed, read, replaced nor joined by files of the other user."""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest

from jax_kvoffload.tiers import DiskTier, DiskTierConfig, UnsafeDirectoryError
from tests.hostmem._forked import NOBODY, Forked, needs_root

NS = bytes(range(32))
KEY = b"\x07" * 32 + bytes(4)


@pytest.fixture
def shared_tmp():
    needs_root()
    base = tempfile.mkdtemp(prefix="jkv-adv-")
    os.chmod(base, 0o1777)  # like /tmp: everyone may create, nobody may rename others'
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _plant(conn, path, kind, target):
    if kind == "dir":
        os.mkdir(path, 0o777)
        os.chmod(path, 0o777)
    else:
        os.mkdir(target, 0o777)
        os.symlink(target, path)
    conn.send("planted")


@pytest.mark.parametrize("kind", ["dir", "link"])
def test_a_directory_or_link_planted_by_another_user_is_refused(shared_tmp, kind):
    path = os.path.join(shared_tmp, "tier")
    child = Forked(_plant, path, kind, os.path.join(shared_tmp, "theirs"), uid=NOBODY)
    assert child.recv() == "planted"
    child.proc.join(10)
    with pytest.raises(UnsafeDirectoryError):
        DiskTier(DiskTierConfig(path=path, capacity_bytes=1 << 20), NS)
    if kind == "link":  # nothing of the victim's was made in the other user's directory
        assert os.listdir(os.path.join(shared_tmp, "theirs")) == []


def _attack(conn, path, entry, ns_dir):
    outcomes = {}
    for name, attempt in {
        "list the tier": lambda: os.listdir(path),
        "read an entry": lambda: os.close(os.open(entry, os.O_RDONLY)),
        "stat an entry": lambda: os.stat(entry),
        "add a file": lambda: open(os.path.join(ns_dir, "x.kv"), "wb").close(),
        "rename the tier": lambda: os.rename(path, path + ".moved"),
        "remove the tier": lambda: shutil.rmtree(path),
    }.items():
        try:
            attempt()
            outcomes[name] = "succeeded"
        except PermissionError:
            outcomes[name] = "refused"
        except OSError as e:
            outcomes[name] = f"refused ({e.errno})"
    conn.send(outcomes)


def test_another_user_cannot_reach_the_entries(shared_tmp):
    path = os.path.join(shared_tmp, "tier")
    tier = DiskTier(DiskTierConfig(path=path, capacity_bytes=1 << 20, fsync=False), NS)
    try:
        row = np.random.default_rng(0).integers(0, 256, 8192, dtype=np.uint8)
        assert tier.submit_store([(KEY, row)]).result(10).ok == (True,)
        (entry,) = [
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".kv")
        ]
        ns_dir = os.path.join(path, NS[:8].hex())
        child = Forked(_attack, path, entry, ns_dir, uid=NOBODY)
        outcomes = child.recv()
        child.proc.join(10)
        assert all(v.startswith("refused") for v in outcomes.values()), outcomes
        out = np.zeros_like(row)
        assert tier.submit_load([(KEY, out)]).result(10).ok == (True,)
        assert (out == row).all()
    finally:
        tier.close()
