"""The shared host region against a second local user, stuck peers, crashes and a full
/dev/shm (issue 12, items 1, 4 and 5; docs/security.md).

Each test that names a defect failed on the file-in-/dev/shm region this replaced. The
victim runs in a forked child where the old code could block forever, so a hang is a
failure after a bound, not a stuck suite. The second user is uid 65534 (tests run as
root here; skipped otherwise).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid

import pytest

from jax_kvoffload.hostmem import SharedHostRegion, _shm_memfd, _shm_rendezvous
from jax_kvoffload.hostmem._shared_region import (
    ForeignPeerError,
    SharedRegionTimeoutError,
    memfd_name,
)
from tests.hostmem._forked import NOBODY, Forked, memfd_mappers, needs_root, shm_entries

pytestmark = pytest.mark.skipif(
    _shm_memfd.unsupported() is not None, reason=str(_shm_memfd.unsupported())
)

NB = 1 << 16
SECRET = bytes(range(1, 251)) * 4  # stands for a user's KV bytes
OLD_HEADER = struct.Struct("<8sQqQQ")  # magic, data bytes, creator pid, expected, attached


def unique() -> str:
    return f"adv-{uuid.uuid4().hex}"


def old_region_file(pid: int, *, expected: int = 2, attached: int = 0) -> bytes:
    """A file in the format the previous region looked for at /dev/shm/<name>."""
    header = OLD_HEADER.pack(b"JAXKVSHM", NB, pid, expected, attached)
    return header.ljust(4096 + NB, b"\0")


# -- another user plants a file where the old region looked ------------------------------


def _plant(conn, path, kind):
    """As another user: puts `kind` at `path`, then stays alive (its pid is the creator
    the forged header names) and reads or writes its file when asked."""
    import fcntl

    if kind == "symlink":
        os.symlink(conn.recv(), path)
    else:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.write(fd, b"garbage" if kind == "garbage" else old_region_file(os.getpid()))
        os.fchmod(fd, 0o600 if kind == "garbage" else 0o666)
        if kind == "locked":
            fcntl.flock(fd, fcntl.LOCK_EX)  # and never lets go
    conn.send("planted")
    while (msg := conn.recv()) != "bye":
        with open(path, "r+b") as f:
            if msg == "read":
                conn.send(f.read())
            else:  # inject
                f.seek(4096)
                f.write(b"\xee" * len(SECRET))
                conn.send("injected")


def _victim(conn, name):
    region = SharedHostRegion(name, NB, 2)
    region.array[: len(SECRET)] = memoryview(SECRET)
    conn.send("attached")
    conn.recv()
    conn.send(bytes(region.array[: len(SECRET)]))
    conn.recv()
    region.close()


@pytest.mark.parametrize("kind", ["region", "locked", "garbage", "symlink"])
def test_a_file_another_user_planted_at_the_name_is_never_used(kind):
    # Before: a 0666 forged region was joined (the attacker read the victim's bytes and
    # injected its own); a held flock blocked the victim forever; a garbage or linked
    # file raised a raw PermissionError or "not a region".
    needs_root()
    name = unique()
    path = f"/dev/shm/{name}"
    fd, mine = tempfile.mkstemp()  # the victim's own file a link could point at
    os.write(fd, b"the victim's file")
    os.close(fd)
    try:
        with Forked(_plant, path, kind, uid=NOBODY) as attacker:
            if kind == "symlink":
                attacker.send(mine)
            assert attacker.recv() == "planted"
            with Forked(_victim, name) as victim:
                assert victim.recv(timeout=20) == "attached"
                if kind != "symlink":
                    attacker.send("read")
                    assert SECRET not in attacker.recv()
                    if kind != "garbage":
                        attacker.send("inject")
                        assert attacker.recv() == "injected"
                victim.send("check")
                assert victim.recv() == SECRET
                victim.send("bye")
                assert victim.join() == 0
            attacker.send("bye")
    finally:
        if os.path.lexists(path):
            os.unlink(path)
        with open(mine, "rb") as f:
            assert f.read() == b"the victim's file"
        os.unlink(mine)


# -- another user on the rendezvous names --------------------------------------------


def _squat(conn, victim_uid, name, role):
    sock = _shm_rendezvous.bind(_shm_rendezvous.address(name, role, uid=victim_uid))
    assert sock is not None
    conn.send("bound")
    conn.recv()


@pytest.mark.parametrize("role", ["lock", "slot0", "slot1"])
def test_another_user_on_a_rendezvous_name_is_a_typed_error_at_once(role):
    needs_root()
    name = unique()
    with Forked(_squat, os.geteuid(), name, role, uid=NOBODY) as squatter:
        assert squatter.recv() == "bound"
        start = time.monotonic()
        with pytest.raises(ForeignPeerError, match=rf"another user \(uid {NOBODY}") as e:
            SharedHostRegion(name, NB, 2, rank=1, timeout=30)
        assert time.monotonic() - start < 10  # not the timeout: a squatter never lets go
        assert (e.value.uid, e.value.pid) == (NOBODY, squatter.pid)
        squatter.send("bye")
    assert memfd_mappers(memfd_name(name)) == []


def _ask_for_memory(conn, victim_uid, name):
    got = []
    for slot in range(2):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            try:
                s.connect(_shm_rendezvous.address(name, f"slot{slot}", uid=victim_uid))
                _, fds, _, _ = socket.recv_fds(s, 64, 4)
            except OSError as e:
                got.append(type(e).__name__)
                continue
            got.append(len(fds))
    conn.send(got)


def test_another_user_asking_for_the_memory_gets_nothing(caplog):
    needs_root()
    name = unique()
    with SharedHostRegion(name, NB, 2) as region:
        region.array[:4] = 7
        with Forked(_ask_for_memory, os.geteuid(), name, uid=NOBODY) as attacker:
            # slot 0 answers without a descriptor; slot 1 has nobody
            assert attacker.recv() == [0, "ConnectionRefusedError"]
        assert f"refused its memory to a process of another user (uid {NOBODY}" in caplog.text
        assert region.attachments() == (1, 2)


# -- bounded waits -----------------------------------------------------------------------


def _hold_lock(conn, name):
    sock = _shm_rendezvous.bind(_shm_rendezvous.address(name, "lock"))
    assert sock is not None
    conn.send("holding")
    conn.recv()


def test_a_lock_held_by_a_stuck_process_of_this_user_times_out_naming_it():
    name = unique()
    with Forked(_hold_lock, name) as stuck:
        assert stuck.recv() == "holding"
        start = time.monotonic()
        with pytest.raises(SharedRegionTimeoutError, match="larger timeout") as e:
            SharedHostRegion(name, NB, 2, timeout=0.5)
        assert 0.5 <= time.monotonic() - start < 5
        assert e.value.pid == stuck.pid and str(stuck.pid) in str(e.value)
        stuck.send("bye")
    with SharedHostRegion(name, NB, 2, timeout=5) as region:  # free once it is gone
        assert region.created


def _hold_region(conn, name, rank=None, value=5):
    region = SharedHostRegion(name, NB, 2, rank=rank)
    seen = bytes(region.array[:8])
    region.array[:4] = value
    conn.send(("attached", seen))
    conn.recv()
    region.close()


def test_a_stopped_holder_is_waited_for_not_replaced():
    # A new memory beside a live holder would split the ranks: time out instead, and
    # join it once it answers again.
    name = unique()
    with Forked(_hold_region, name) as holder:
        assert holder.recv()[0] == "attached"
        holder.stop()
        try:
            with pytest.raises(SharedRegionTimeoutError, match="did not hand it over"):
                SharedHostRegion(name, NB, 2, timeout=1)
        finally:
            holder.signal(signal.SIGCONT)
        with SharedHostRegion(name, NB, 2, timeout=10) as late:
            assert not late.created and bytes(late.array[:4]) == b"\5" * 4
        holder.send("bye")


# -- pid reuse and crashes ----------------------------------------------------------------


def test_a_crashed_runs_file_whose_creator_pid_is_alive_again_does_not_split_the_ranks():
    # Before: rank 0 joined the stale file (its "creator" pid alive again, one attachment
    # short) and unlinked it; rank 1 then made a new file: two memories, silently.
    name = unique()
    path = f"/dev/shm/{name}"
    with open(path, "wb") as f:
        f.write(old_region_file(os.getpid(), attached=1))
    try:
        a = SharedHostRegion(name, NB, 2)
        b = SharedHostRegion(name, NB, 2)
        a.array[:3] = 42
        assert bytes(b.array[:3]) == b"\x2a" * 3
        a.close()
        b.close()
    finally:
        os.unlink(path)


def test_a_sigkilled_worker_leaves_nothing_behind():
    # Before: its region file (GiBs in production) stayed in /dev/shm forever.
    name = unique()
    with Forked(_hold_region, name) as worker:
        assert worker.recv()[0] == "attached"
        assert memfd_mappers(memfd_name(name)) == [worker.pid]
        assert worker.kill() == -signal.SIGKILL
    assert shm_entries(name) == []
    assert memfd_mappers(memfd_name(name)) == []
    with SharedHostRegion(name, NB, 2) as restarted:  # a new run starts clean
        assert restarted.created and not restarted.array.any()


def test_sigkilled_ranks_of_a_complete_group_leave_nothing_behind():
    name = unique()
    ranks = [Forked(_hold_region, name, r) for r in range(2)]
    try:
        assert [r.recv()[0] for r in ranks] == ["attached"] * 2
        assert sorted(memfd_mappers(memfd_name(name))) == sorted(r.pid for r in ranks)
        for r in ranks:
            r.kill()
    finally:
        for r in ranks:
            r.__exit__()
    assert shm_entries(name) == [] and memfd_mappers(memfd_name(name)) == []


def test_a_rank_that_restarts_after_the_creator_died_joins_the_survivors_memory():
    # Before: the dead creator's file was "stale" and replaced by a new one (a split).
    name = unique()
    with Forked(_hold_region, name, 0) as creator:
        assert creator.recv() == ("attached", b"\0" * 8)
        survivor = SharedHostRegion(name, NB, 2, rank=1)
        creator.kill()
    try:
        survivor.array[4:8] = 1
        with Forked(_hold_region, name, 0, 6) as restarted:
            assert restarted.recv() == ("attached", b"\5" * 4 + b"\1" * 4)  # our memory
            assert bytes(survivor.array[:4]) == b"\6" * 4  # and its write, here
            restarted.send("bye")
            assert restarted.join() == 0
    finally:
        survivor.close()
    assert memfd_mappers(memfd_name(name)) == []


# -- a full /dev/shm ---------------------------------------------------------------------

_FILL = textwrap.dedent(
    """
    import sys
    from jax_kvoffload.hostmem import SharedHostRegion
    with SharedHostRegion(sys.argv[1], 4 << 20, 2) as r:
        r.array[:] = 0xAB  # every page: a SIGBUS would kill us here
        assert (r.array == 0xAB).all()
    print("ok")
    """
)


def test_a_full_dev_shm_does_not_matter():
    # Before: the region lived in /dev/shm; with Docker's 64 MiB default it could not be
    # made. Now it is a memfd: a 1 MiB /dev/shm (a private mount) holds a 4 MiB region.
    needs_root()
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    name = unique()
    script = f'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec {sys.executable} -c "$0" "$1"'
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
        capture_output=True,
        timeout=30,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm here: {probe.stderr.decode()[:200]}")
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, _FILL, name],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (result.returncode, result.stdout.strip()) == (0, "ok"), result.stderr[-2000:]
