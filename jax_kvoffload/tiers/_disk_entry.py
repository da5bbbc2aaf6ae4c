"""The bytes of one disk-tier entry file: writing header + payload, reading them back
and verifying them.

The tier (`_disk.py`) names, opens, renames and removes the files and keeps the
accounting; these functions only move and check the bytes of a file it holds open, so
the on-disk format and the direct-I/O staging rules live in one place. With direct I/O,
page-aligned buffers are read and written in place; other buffers pass through the
caller's aligned `StagingBuffer`.
"""

from __future__ import annotations

import os

from jax_kvoffload.tiers._crc import crc32c
from jax_kvoffload.tiers._disk_fs import (
    ALIGN,
    StagingBuffer,
    describe_file,
    is_aligned,
    read_all,
    stored_length,
    write_all,
)
from jax_kvoffload.tiers._entry import check_header

__all__ = ["read_entry", "write_entry"]


def write_entry(
    fd: int, stage: StagingBuffer, header: bytes, payload: memoryview, direct_io: bool
) -> int:
    """Writes `header` (one `ALIGN` block) then `payload` to the new file open at `fd`;
    returns the file's size (padded to a whole block with direct I/O)."""
    total = ALIGN + len(payload)
    if not direct_io:
        write_all(fd, [header, payload], total)
        return total
    if is_aligned(payload):
        head = stage.view(ALIGN)
        head[:] = header
        write_all(fd, [head, payload], total)
        return total
    size = -(-total // ALIGN) * ALIGN
    buf = stage.view(size)
    buf[:ALIGN] = header
    buf[ALIGN:total] = payload
    buf[total:] = bytes(size - total)
    write_all(fd, [buf], size)
    return size


def read_entry(
    fd: int,
    st: os.stat_result,
    stage: StagingBuffer,
    namespace: bytes,
    key: bytes,
    out: memoryview,
    direct_io: bool,
) -> bool | int | str:
    """Reads the entry open at `fd` (`st`: its fstat) into `out` and verifies it: True
    (a verified hit, `out` filled), the payload length of a whole entry of this key that
    `out` does not fit (the file is good: keep it), or why the file is bad (a str: the
    caller removes it). OSError propagates."""
    kind = describe_file(st)
    if kind is not None:  # `open_regular` opened none; checked again all the same
        return kind
    n = len(out)
    total = ALIGN + n
    if not total <= st.st_size <= -(-total // ALIGN) * ALIGN:
        # Not this payload's size: a bad file, or a whole entry of another length
        # (the caller's buffer is wrong): only the header can tell them apart.
        other = stored_length(fd, stage, namespace, key, st.st_size)
        if other is not None:
            return other
        return f"size {st.st_size} for a payload of {n}"
    if not direct_io or is_aligned(out):
        head = stage.view(ALIGN)
        got = read_all(fd, [head, out], total)
    else:
        size = -(-total // ALIGN) * ALIGN
        buf = stage.view(size)
        got = read_all(fd, [buf], total)
        head = buf[:ALIGN]
    if got < total:
        return "short read"
    hdr = check_header(head, namespace=namespace, key=key)
    if not isinstance(hdr, str) and hdr.payload_len != n:
        other = stored_length(fd, stage, namespace, key, st.st_size)
        if other is not None:  # a whole entry a byte or so longer or shorter
            return other
        hdr = f"payload length {hdr.payload_len} != expected {n}"
    if isinstance(hdr, str):
        return hdr
    if direct_io and not is_aligned(out):
        out[:] = buf[ALIGN:total]
    if crc32c(out) != hdr.payload_crc:
        return "payload checksum mismatch"
    return True
