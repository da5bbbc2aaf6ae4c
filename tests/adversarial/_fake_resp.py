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
