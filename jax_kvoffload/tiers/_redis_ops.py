"""The Redis tier's commands, one item at a time: SET of an entry, GET straight into
the destination row (header first, checked before a payload byte lands), EXISTS.

Value: the entry header (`_entry.py`, 68 + key bytes) followed by the payload; one SET
writes it whole (single-key writes are atomic on the server), one GET reads it whole.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax_kvoffload.tiers._crc import crc32c
from jax_kvoffload.tiers._entry import check_header, encode_header, header_length
from jax_kvoffload.tiers._redis_exchange import Op
from jax_kvoffload.tiers._resp import Part, Reply, RespConnection, RespServerError, command

__all__ = ["ExistsOp", "GetOp", "SetOp"]


class SetOp(Op):
    """`SET <rkey> <header + payload> [EX ttl]` per item; a reply is "OK" or an error."""

    name = "SET"

    def __init__(
        self,
        namespace: bytes,
        rkeys: list[bytes],
        items: Sequence[tuple[bytes, memoryview]],
        ttl_s: int | None,
    ) -> None:
        self._namespace = namespace
        self._rkeys = rkeys
        self._items = items
        self._expiry = (b"EX", str(ttl_s).encode()) if ttl_s else ()
        self._built: dict[int, list[Part]] = {}  # a redirected item is sent again as it was

    def parts(self, i: int) -> list[Part]:
        built = self._built.get(i)
        if built is None:
            key, payload = self._items[i]
            rkey = self._rkeys[i]
            header = encode_header(self._namespace, key, len(payload), crc32c(payload))
            nargs = 3 + len(self._expiry)
            tail = b"".join(b"\r\n$%d\r\n%s" % (len(a), a) for a in self._expiry)
            built = self._built[i] = [
                b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n"
                % (nargs, len(rkey), rkey, len(header) + len(payload)),
                header,
                payload,
                tail + b"\r\n",
            ]
        return built

    def read(self, conn: RespConnection, i: int) -> Reply:
        reply = conn.read_reply()
        if reply != "OK" and not isinstance(reply, RespServerError):
            raise conn.unexpected(reply, "SET")
        return reply


class ExistsOp(Op):
    """`EXISTS <rkey>` per item; a reply is 0, 1 or an error."""

    name = "EXISTS"

    def __init__(self, rkeys: list[bytes]) -> None:
        self._rkeys = rkeys

    def parts(self, i: int) -> list[Part]:
        return [command(b"EXISTS", self._rkeys[i])]

    def read(self, conn: RespConnection, i: int) -> Reply:
        reply = conn.read_reply()
        if not isinstance(reply, (int, RespServerError)):
            raise conn.unexpected(reply, "EXISTS")
        return reply


class GetOp(Op):
    """`GET <rkey>` per item, read into the item's `out` buffer. A reply is None (a
    verified hit), "absent", what is wrong with the stored value (a str: such entries
    are deleted on the node that held them), the payload length of a whole entry that
    `out` does not fit (an int), or the server's error."""

    name = "GET"

    def __init__(
        self, namespace: bytes, rkeys: list[bytes], items: Sequence[tuple[bytes, memoryview]]
    ) -> None:
        self._namespace = namespace
        self._rkeys = rkeys
        self._items = items

    def parts(self, i: int) -> list[Part]:
        return [command(b"GET", self._rkeys[i])]

    def read(self, conn: RespConnection, i: int) -> Reply:
        key, out = self._items[i]
        return read_value(conn, self._namespace, key, out)

    def after(self, conn: RespConnection, items: list[int], replies: list[Reply]) -> None:
        # One DEL per key: a cluster refuses a DEL of keys in several slots. A concurrent
        # rewrite may be lost: a future miss, never a wrong byte.
        bad = [self._rkeys[i] for i, r in zip(items, replies, strict=True) if is_bad(r)]
        if bad:
            conn.send([command(b"DEL", k) for k in bad])
            for _ in bad:
                reply = conn.read_reply()
                if not isinstance(reply, (int, RespServerError)):
                    raise conn.unexpected(reply, "DEL")


def is_bad(reason: object) -> bool:
    """Whether a GET reply says the stored value is damaged or not ours."""
    return isinstance(reason, str) and reason != "absent"


def read_value(
    conn: RespConnection, namespace: bytes, key: bytes, out: memoryview
) -> str | int | RespServerError | None:
    """Reads one GET reply into `out` (see `GetOp`)."""
    n = conn.read_bulk_header()
    if isinstance(n, RespServerError):
        return n
    if n < 0:
        return "absent"
    hlen = header_length(len(key))
    if n != hlen + len(out):
        if n < hlen:
            conn.skip(n)
            conn.end_bulk()
            return f"value of {n} bytes for a payload of {len(out)}"
        # A bad value, or a whole entry of another length (the caller's buffer is
        # wrong, not the entry): the header tells them apart.
        head = bytearray(hlen)
        conn.read_into(memoryview(head))
        conn.skip(n - hlen)
        conn.end_bulk()
        hdr = check_header(head, namespace=namespace, key=key)
        if not isinstance(hdr, str) and hdr.payload_len == n - hlen:
            return hdr.payload_len
        return f"value of {n} bytes for a payload of {len(out)}"
    head = bytearray(hlen)
    conn.read_into(memoryview(head))
    hdr = check_header(head, namespace=namespace, key=key, payload_len=len(out))
    if isinstance(hdr, str):
        conn.skip(len(out))
        conn.end_bulk()
        return hdr
    conn.read_into(out)
    conn.end_bulk()
    if crc32c(out) != hdr.payload_crc:
        return "payload checksum mismatch"
    return None
