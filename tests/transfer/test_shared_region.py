"""`SharedHostRegion`: one host memory for several processes, published atomically,
unlinked by the last expected attachment, stale names replaced, sizes checked."""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest

from jax_kvoffload.transfer import SharedHostRegion, SharedRegionError


def _child(name, directory, nbytes, value, ready, go):
    region = SharedHostRegion(name, nbytes, 2, directory=directory)
    region.array[nbytes // 2 :] = value  # writes the second half
    ready.set()
    go.wait(30)
    region.close()


def test_two_processes_share_bytes_and_the_last_attachment_unlinks(tmp_path):
    name, nbytes = "region-a", 1 << 16
    region = SharedHostRegion(name, nbytes, 2, directory=tmp_path)
    assert region.created and (tmp_path / name).exists()
    region.array[: nbytes // 2] = 3
    ctx = mp.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_child, args=(name, str(tmp_path), nbytes, 5, ready, go))
    p.start()
    try:
        assert ready.wait(60), "the child did not attach"
        assert not (tmp_path / name).exists()  # both attached: the name is gone
        assert (region.array[: nbytes // 2] == 3).all()
        assert (region.array[nbytes // 2 :] == 5).all()  # the child's bytes, here
    finally:
        go.set()
        p.join(60)
    assert p.exitcode == 0
    region.close()
    region.close()  # idempotent


def test_a_size_mismatch_is_an_error_naming_both_sizes(tmp_path):
    with (
        SharedHostRegion("r", 4096, 2, directory=tmp_path),
        pytest.raises(SharedRegionError, match=r"holds 4096 bytes .* asks for 8192"),
    ):
        SharedHostRegion("r", 8192, 2, directory=tmp_path)


def test_a_name_left_by_a_dead_creator_is_replaced(tmp_path):
    region = SharedHostRegion("r", 4096, 3, directory=tmp_path)
    region.array[:] = 1
    # Pretend the creator died: rewrite its pid to one that cannot exist.
    with open(tmp_path / "r", "r+b") as f:
        f.seek(16)
        f.write((2**31 - 2).to_bytes(8, "little", signed=True))
    fresh = SharedHostRegion("r", 4096, 3, directory=tmp_path)
    assert fresh.created and not fresh.array.any()
    region.close()  # the old creator leaves the new run's name alone
    assert (tmp_path / "r").exists()
    fresh.close()
    assert not (tmp_path / "r").exists()


def test_bad_arguments_and_foreign_files_are_refused(tmp_path):
    with pytest.raises(SharedRegionError, match="one file name"):
        SharedHostRegion("a/b", 10, 1, directory=tmp_path)
    with pytest.raises(SharedRegionError, match="expected_attachments"):
        SharedHostRegion("x", 10, 0, directory=tmp_path)
    (tmp_path / "foreign").write_bytes(b"\0" * 8192)
    with pytest.raises(SharedRegionError, match="not a jax_kvoffload region"):
        SharedHostRegion("foreign", 10, 1, directory=tmp_path)


def test_one_expected_attachment_unlinks_at_once_and_keeps_the_memory(tmp_path):
    region = SharedHostRegion("solo", 100, 1, directory=tmp_path)
    assert not (tmp_path / "solo").exists()
    region.array[:] = np.arange(100, dtype=np.uint8)
    assert region.array.sum() == sum(range(100))
    region.close()
    assert os.listdir(tmp_path) == []


def test_closing_with_live_views_still_removes_an_incomplete_name(tmp_path):
    region = SharedHostRegion("views", 4096, 2, directory=tmp_path)
    rows = region.array.reshape(4, 1024)  # a pool's rows outlive the close
    rows[:] = 7
    region.close()
    assert not (tmp_path / "views").exists()
    assert (rows == 7).all()  # still mapped while the view lives


def _stale_file(path, size=4096, want=2, attached=1):
    from jax_kvoffload.transfer._shared_region import _HEADER, HEADER_BYTES

    dead = 2**31 - 2  # no such pid
    path.write_bytes(
        _HEADER.pack(b"JAXKVSHM", size, dead, want, attached).ljust(HEADER_BYTES + size, b"\0")
    )


def test_a_late_replacer_never_removes_the_newer_region(tmp_path):
    # Two processes find a crashed run's file; the first replaces it. The second, still
    # holding the old file, must not unlink the name now pointing at the new one.
    _stale_file(tmp_path / "r")
    old = os.open(tmp_path / "r", os.O_RDWR)
    first = SharedHostRegion("r", 4096, 2, directory=tmp_path)
    second = object.__new__(SharedHostRegion)
    second.path = tmp_path / "r"
    try:
        assert second._attach(old, 4096, 2) is False  # stale, and no longer the name
        assert (tmp_path / "r").exists()
        joined = SharedHostRegion("r", 4096, 2, directory=tmp_path)
        first.array[0] = 9
        assert joined.array[0] == 9  # both on the new region
        joined.close()
    finally:
        os.close(old)
        first.close()


def test_a_mount_too_small_is_an_error_not_a_sigbus_later(tmp_path, monkeypatch):
    import errno

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    with pytest.raises(SharedRegionError, match="--shm-size"):
        SharedHostRegion("big", 1 << 20, 2, directory=tmp_path)
    assert os.listdir(tmp_path) == []
