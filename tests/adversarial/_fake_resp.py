"""A scripted Redis-protocol server on a free loopback port, for hostile answers.

`FakeResp(reply)` answers each command it parses with `reply(conn_index, args)` (bytes
sent as they are: garbage, wrong lengths, stale replies). `connections` counts accepted
connections; `stop()` closes everything (tests use it as a context manager).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable


def _parse(buf: bytes) -> tuple[list[bytes], bytes] | None:
    """One RESP array command from the head of `buf`, or None if incomplete."""
    try:
        i = buf.index(b"\r\n")
        n, p, args = int(buf[1:i]), i + 2, []
        for _ in range(n):
            j = buf.index(b"\r\n", p)
            size = int(buf[p + 1 : j])
            p = j + 2
            if len(buf) < p + size + 2:
                return None
            args.append(buf[p : p + size])
            p += size + 2
    except ValueError:  # an incomplete line
        return None
    return args, buf[p:]


class FakeResp:
    def __init__(self, reply: Callable[[int, list[bytes]], bytes]) -> None:
        self.reply = reply
        self.connections = 0
        self.commands: list[tuple[int, list[bytes]]] = []
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                index = self.connections
                self.connections += 1
                self._conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn, index), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket, index: int) -> None:
        buf = b""
        while True:
            try:
                data = conn.recv(1 << 20)
            except OSError:
                return
            if not data:
                return
            buf += data
            while (got := _parse(buf)) is not None:
                args, buf = got
                with self._lock:
                    self.commands.append((index, args))
                with contextlib.suppress(OSError):
                    conn.sendall(self.reply(index, args))

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            for c in self._conns:
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)
                c.close()
        for t in self._threads:
            t.join(5)

    def __enter__(self) -> FakeResp:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Err(str):
    """An error reply's text, for `resp()`."""


def resp(value: object) -> bytes:
    """`value` as RESP: None a nil bulk, int, bytes (bulk), str (status), `Err`, list."""
    if value is None:
        return b"$-1\r\n"
    if isinstance(value, Err):
        return b"-" + value.encode() + b"\r\n"
    if isinstance(value, bool) or not isinstance(value, (int, bytes, str, list)):
        raise TypeError(f"cannot encode {type(value).__name__}")
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, bytes):
        return b"$%d\r\n%s\r\n" % (len(value), value)
    if isinstance(value, str):
        return b"+" + value.encode() + b"\r\n"
    return b"*%d\r\n" % len(value) + b"".join(resp(v) for v in value)


def shards(*ranges: tuple[int, int, int], host: bytes = b"127.0.0.1") -> bytes:
    """A CLUSTER SHARDS reply: one shard per `(first slot, last slot, primary port)`."""
    out = []
    for first, last, port in ranges:
        node = [b"id", b"%040d" % port, b"port", port, b"ip", host, b"endpoint", host,
                b"role", b"master", b"health", b"online"]  # fmt: skip
        out.append([b"slots", [first, last], b"nodes", [node]])
    return resp(out)


class FakeNode(FakeResp):
    """A fake cluster node with a keyspace of its own (SET, GET, EXISTS, DEL, ASKING,
    PING answered from a dict). `hook(conn, args)` answers first where it returns bytes
    (a redirect, a slot map, garbage); None lets the keyspace answer. `asked` counts
    commands that came right after an ASKING on their connection."""

    def __init__(self, hook: Callable[[int, list[bytes]], bytes | None] | None = None) -> None:
        self.data: dict[bytes, bytes] = {}
        self.hook = hook
        self.asked: list[list[bytes]] = []
        self._asking: set[int] = set()
        super().__init__(self._answer)

    def _answer(self, conn: int, args: list[bytes]) -> bytes:
        name = args[0].upper()
        if name == b"ASKING":
            self._asking.add(conn)
            return b"+OK\r\n"
        if conn in self._asking:
            self._asking.discard(conn)
            self.asked.append(args)
        if self.hook is not None and (out := self.hook(conn, args)) is not None:
            return out
        if name == b"SET":
            self.data[args[1]] = args[2]
            return b"+OK\r\n"
        if name == b"GET":
            return resp(self.data.get(args[1]))
        if name == b"EXISTS":
            return resp(int(args[1] in self.data))
        if name == b"DEL":
            return resp(sum(self.data.pop(k, None) is not None for k in args[1:]))
        if name == b"PING":
            return b"+PONG\r\n"
        return resp(Err(f"ERR unknown command '{args[0].decode(errors='replace')}'"))

    def count(self, *names: bytes) -> int:
        """Commands received whose first words are `names` (e.g. b"CLUSTER", b"SHARDS")."""
        with self._lock:
            return sum([a.upper() for a in args[: len(names)]] == list(names)
                       for _, args in self.commands)  # fmt: skip
