"""`SharedHostRegion`: one host memory for the processes of one run, found by name,
counted per slot, sized alike, sealed, and never a file (docs/security.md).

Adversaries (another local user, crashes, stuck peers, full /dev/shm) are in
tests/security/test_shared_region_adversary.py."""

from __future__ import annotations

import errno
import os
import socket
import tempfile
import uuid

import numpy as np
import pytest

from jax_kvoffload.hostmem import SharedHostRegion, SharedRegionError, _shm_memfd, _shm_rendezvous
from jax_kvoffload.hostmem._shared_region import SharedRegionArgumentError, memfd_name
from tests.hostmem._forked import Forked, memfd_mappers, shm_entries

pytestmark = pytest.mark.skipif(
    _shm_memfd.unsupported() is not None, reason=str(_shm_memfd.unsupported())
)


def unique() -> str:
    return f"test-{uuid.uuid4().hex}"  # other helpers' tests share this machine's names


def _attach_and_write(conn, name, nbytes, value, rank=None):
    region = SharedHostRegion(name, nbytes, 2, rank=rank)
    region.array[nbytes // 2 :] = value  # the second half
    conn.send(region.attachments())
    conn.recv()  # the parent has looked
    region.close()


def test_two_processes_share_one_memory_and_no_file_is_ever_made():
    name, nbytes = unique(), 1 << 16
    region = SharedHostRegion(name, nbytes, 2)
    assert region.created and region.attachments() == (1, 2)
    region.array[: nbytes // 2] = 3
    with Forked(_attach_and_write, name, nbytes, 5) as child:
        assert child.recv() == (2, 2)
        assert region.attachments() == (2, 2)
        assert (region.array[: nbytes // 2] == 3).all()
        assert (region.array[nbytes // 2 :] == 5).all()  # the child's bytes, here
        assert shm_entries(name) == []
        child.send("go")
        assert child.join() == 0
    region.close()
    region.close()  # idempotent
    assert memfd_mappers(region.memfd_name) == []  # the memory is gone with its holders


def test_a_size_mismatch_is_an_error_naming_both_sizes():
    name = unique()
    with (
        SharedHostRegion(name, 4096, 2),
        pytest.raises(SharedRegionError, match=r"holds 4096 bytes .* asks for 8192"),
    ):
        SharedHostRegion(name, 8192, 2)


def test_a_holder_sized_for_more_processes_is_found_not_bypassed():
    # rank 3 of 4 made it; a process told to expect 2 must see it (and refuse it)
    # instead of making a second memory beside it.
    name = unique()
    with (
        SharedHostRegion(name, 4096, 4, rank=3),
        pytest.raises(SharedRegionError, match=r"for 4 processes .* for 2"),
    ):
        SharedHostRegion(name, 4096, 2)


def test_one_process_more_than_the_region_was_sized_for_is_refused():
    # Before: the second attachment unlinked the name and a third process silently made
    # its own region, so ranks of one engine used different memory.
    name = unique()
    a, b = SharedHostRegion(name, 4096, 2), SharedHostRegion(name, 4096, 2)
    try:
        with pytest.raises(SharedRegionError, match="sized for 2 processes"):
            SharedHostRegion(name, 4096, 2)
        a.array[0] = 9
        assert b.array[0] == 9
    finally:
        a.close()
        b.close()


def test_two_live_processes_with_one_rank_are_refused():
    name = unique()
    with SharedHostRegion(name, 4096, 2, rank=1) as first:
        with pytest.raises(
            SharedRegionError, match=rf"rank 1 is already attached by process {os.getpid()}"
        ):
            SharedHostRegion(name, 4096, 2, rank=1)
        with SharedHostRegion(name, 4096, 2, rank=0) as other:
            assert (first.slot, other.slot) == (1, 0)
            assert other.attachments() == (2, 2)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("", 10, 1), {}, "name must be a non-empty string"),
        ((b"x", 10, 1), {}, "name must be a non-empty string"),
        (("x", -1, 1), {}, "nbytes must be >= 0"),
        (("x", 10, 0), {}, r"expected_attachments must be in \[1, 256\]"),
        (("x", 10, 257), {}, "expected_attachments"),
        (("x", 10.0, 1), {}, "must be integers"),
        (("x", 10, 2), {"rank": 2}, r"rank must be in \[0, expected_attachments=2\)"),
        (("x", 10, 2), {"rank": -1}, "rank must be in"),
        (("x", 10, 2), {"timeout": -1}, "timeout must be a finite number"),
        (("x", 10, 2), {"timeout": float("inf")}, "timeout must be"),
        (("x", 10, 2), {"timeout": "soon"}, "timeout must be"),
    ],
)
def test_bad_arguments_are_value_errors_naming_the_parameter(args, kwargs, match):
    with pytest.raises(SharedRegionArgumentError, match=match) as e:
        SharedHostRegion(*args, **kwargs)
    assert isinstance(e.value, ValueError) and isinstance(e.value, SharedRegionError)


def test_numpy_integers_are_accepted():
    with SharedHostRegion(unique(), np.int64(100), np.int32(1), rank=np.int64(0)) as r:
        assert r.array.shape == (100,)


def test_one_expected_attachment_keeps_its_memory_until_closed():
    region = SharedHostRegion(unique(), 100, 1)
    region.array[:] = np.arange(100, dtype=np.uint8)
    assert region.array.sum() == sum(range(100))
    assert region.attachments() == (1, 1)
    region.close()
    with pytest.raises(SharedRegionError, match="closed"):
        region.attachments()


def test_closing_with_live_views_keeps_them_valid():
    region = SharedHostRegion(unique(), 4096, 2)
    rows = region.array.reshape(4, 1024)  # a pool's rows outlive the close
    rows[:] = 7
    region.close()
    assert (rows == 7).all()  # still mapped while the view lives


def test_any_holder_serves_the_memory_after_the_creator_left():
    name = unique()
    a = SharedHostRegion(name, 64, 3)
    a.array[:] = 1
    b = SharedHostRegion(name, 64, 3)
    a.close()  # the creator goes first; b still holds the memory
    c = SharedHostRegion(name, 64, 3)
    try:
        assert not c.created and (c.array == 1).all()
        b.array[0] = 9
        assert c.array[0] == 9
        assert c.attachments() == (3, 3)  # a never-used slot was taken, not a's old one
    finally:
        b.close()
        c.close()


def test_the_memory_is_sealed_against_resizing():
    # A shrink would turn every other process's next access into a SIGBUS.
    with SharedHostRegion(unique(), 8192, 2) as region:
        for size in (0, 4096, 1 << 20):
            with pytest.raises(PermissionError):
                os.ftruncate(region._fd, size)
        region.array[-1] = 1  # still all there


def _fake_holder(conn, addr, kind):
    """A process of this user on slot 0 that hands over `kind` of memory."""
    if kind == "file":
        fd, path = tempfile.mkstemp()
        os.unlink(path)
        os.ftruncate(fd, 8192)
    else:
        fd = os.memfd_create("jax_kvoffload:fake", os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, _shm_memfd.HEADER_BYTES + 4096)
        header = _shm_memfd.HEADER.pack(_shm_memfd.MAGIC, 1, os.getpid(), 4096, 2, b"\0" * 16)
        os.pwrite(fd, header, 0)
        if kind == "unsealed":
            os.fchmod(fd, 0o600)
    sock = _shm_rendezvous.bind(addr)
    conn.send("ready")
    c, _ = sock.accept()
    socket.send_fds(c, [_shm_rendezvous.HELLO], [fd])
    conn.recv()


@pytest.mark.parametrize(
    ("kind", "match"),
    [("file", "not a memfd"), ("open", "not a private region"), ("unsealed", "not sealed")],
)
def test_memory_handed_over_is_checked_before_it_is_mapped(kind, match):
    name = unique()
    addr = _shm_rendezvous.address(name, "slot0")
    with Forked(_fake_holder, addr, kind) as holder:
        assert holder.recv() == "ready"
        with pytest.raises(SharedRegionError, match=match):
            SharedHostRegion(name, 4096, 2, timeout=10)
        holder.send("done")


def test_a_reservation_that_fails_is_an_error_naming_the_knobs(monkeypatch):
    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    name = unique()
    with pytest.raises(SharedRegionError, match=r"cpu_bytes_to_use.*--shm-size"):
        SharedHostRegion(name, 1 << 20, 2)
    monkeypatch.undo()
    with SharedHostRegion(name, 1 << 20, 2) as again:  # nothing half made was left
        assert again.created


def test_a_size_no_memory_here_could_hold_is_refused_before_reserving():
    if not _shm_memfd._memory_limits():
        pytest.skip("no memory limit readable here: a reservation would really be tried")
    with pytest.raises(SharedRegionError, match=r"cannot reserve .*MemAvailable|memory limit"):
        SharedHostRegion(unique(), 1 << 50, 2)


def _attach_rank(conn, name, nbytes, world, rank):
    conn.recv()  # all start together
    region = SharedHostRegion(name, nbytes, world, rank=rank)
    region.array[rank] = rank + 1
    conn.send(region.created)
    conn.recv()  # every rank has written
    conn.send((bytes(region.array[:world]), region.attachments()))
    conn.recv()
    region.close()


def test_concurrent_attachers_share_one_memory():
    name, world = unique(), 4
    children = [Forked(_attach_rank, name, 4096, world, r) for r in range(world)]
    try:
        for c in children:
            c.send("go")
        assert sum(c.recv() for c in children) == 1  # exactly one made the memory
        for c in children:
            c.send("look")
        want = (bytes(range(1, world + 1)), (world, world))
        assert [c.recv() for c in children] == [want] * world
        for c in children:
            c.send("bye")
        assert [c.join() for c in children] == [0] * world
    finally:
        for c in children:
            c.__exit__()
    assert memfd_mappers(memfd_name(name)) == []


def _idle(conn):
    conn.send("up")  # the fork hooks have run: the child dropped the inherited names
    conn.recv()


def test_a_forked_child_of_a_holder_does_not_keep_its_name():
    # The child has the memory mapped but no thread to serve it; were it to keep the
    # slot name, the next run would wait on it for an answer that never comes.
    name = unique()
    region = SharedHostRegion(name, 4096, 2, rank=0)
    with Forked(_idle) as child:
        child.recv()  # else, on a busy machine, the parent may rebind before they ran
        region.close()
        with SharedHostRegion(name, 4096, 2, rank=0, timeout=5) as fresh:
            assert fresh.created
        child.send("bye")
