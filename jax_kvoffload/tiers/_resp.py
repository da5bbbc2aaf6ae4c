"""A small client of the Redis serialization protocol (RESP2), built for large values.

Why our own (measured in benchmarks/tiers.py `--clients`): a value goes out with one
`sendmsg` of the command prefix, the entry header and the host row itself (no copy
into a command buffer), and a GET reply is read straight into the destination row
(`recv_into`), header first, so it can be checked before a byte lands in the row's
payload. redis-py and coredis copy each value into `bytes` at least once on each side.
It speaks only what the tier needs: AUTH, SELECT, SET, GET, EXISTS, DEL, pipelined, and
ASKING and CLUSTER SHARDS / SLOTS for a cluster.

Every operation has a deadline (`io_timeout_s` for a whole pipelined batch); a timeout,
a reset, or a protocol surprise closes the connection (`RespConnectionError`), so a
connection is either in sync with the server or gone.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias, cast

from jax_kvoffload._threads import start_threads

__all__ = ["Endpoint", "Reply", "RespConnection", "RespConnectionError", "RespServerError"]

_CRLF = b"\r\n"
_IOV_MAX = 512  # below Linux's 1024 iovec limit per sendmsg
_RECV_CHUNK = 1 << 16
_SOCK_BUF = 4 << 20  # large socket buffers keep multi-MiB values streaming
# Replies other than GET values (which `read_bulk_header` streams into their rows) are
# small: +OK, integers, AUTH/SELECT answers, a cluster's slot map (read with a larger
# `max_items`). Anything larger or nested deeper is a server out of its mind: the
# connection is dropped instead of allocating or recursing on its say.
_MAX_SMALL_BULK = 1 << 20
_MAX_ARRAY = 1024
_MAX_DEPTH = 4
_MAX_DIGITS = 20  # a RESP length or integer fits in 64 bits


class RespConnectionError(ConnectionError):
    """The connection failed, timed out or lost sync; it is closed. `timed_out` tells a
    silent server (worth no retry) from a reset or closed connection."""

    timed_out = False


class RespServerError(Exception):
    """The server answered an error reply (e.g. `-OOM`, `-NOAUTH`); the connection is fine."""


# One RESP2 reply as `read_reply` returns it: a simple string (+), an integer (:), a bulk
# string or nil ($), an array of replies (*), or an error reply (-) as its exception.
Reply: TypeAlias = str | int | bytes | RespServerError | list["Reply"] | None
# What `send` takes: buffers sent as they are (the command prefix, an entry's header, a
# host row), never joined.
Part: TypeAlias = bytes | bytearray | memoryview
# `getaddrinfo`'s (family, type, proto, canonname, sockaddr).
_AddrInfo: TypeAlias = tuple[
    socket.AddressFamily,
    socket.SocketKind,
    int,
    str,
    tuple[str, int] | tuple[str, int, int, int] | tuple[int, bytes],
]


@dataclass(frozen=True)
class Endpoint:
    """Where and how to connect (from `RedisTierConfig`)."""

    host: str | None
    port: int
    unix_path: str | None
    db: int
    username: str | None
    password: str | None
    tls: ssl.SSLContext | None
    server_name: str | None
    connect_timeout_s: float
    io_timeout_s: float

    def describe(self) -> str:
        scheme = "unix" if self.unix_path else ("rediss" if self.tls else "redis")
        where = self.unix_path if self.unix_path else f"{self.host}:{self.port}"
        return f"{scheme}://{where}/{self.db}"


# Name lookups that outlived their caller's bound, still running (getaddrinfo cannot be
# cancelled): past this many, a new lookup fails at once instead of adding a thread.
_MAX_STUCK_LOOKUPS = 8
_lookups_running = threading.BoundedSemaphore(_MAX_STUCK_LOOKUPS)


def _resolve(host: str, port: int, timeout: float) -> Sequence[_AddrInfo]:
    """`getaddrinfo` bounded by `timeout`: a literal address at once, a name on a daemon
    thread (the C resolver has no timeout of its own: a slow DNS server held a connect
    for its own retries, 5 s or more per server, past `connect_timeout_s`)."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass  # a name: look it up with a bound
    if not _lookups_running.acquire(blocking=False):
        raise OSError(f"name lookups of {host!r} hang ({_MAX_STUCK_LOOKUPS} still running)")
    out: list[Sequence[_AddrInfo] | BaseException] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            out.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except BaseException as e:  # handed to the caller
            out.append(e)
        finally:
            _lookups_running.release()
            done.set()

    # Out of threads: no lookup runs, its slot is free again, and connecting fails.
    thread = threading.Thread(target=lookup, name="redis-tier-resolve", daemon=True)
    start_threads(
        [thread], error=OSError, owner="the redis tier", stop=lambda _: _lookups_running.release()
    )
    if not done.wait(timeout):
        raise TimeoutError(f"name lookup of {host!r} took longer than {timeout:g} s")
    got = out[0]
    if isinstance(got, BaseException):
        raise got
    return got


def _connect_tcp(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to `host:port`; lookup and connect together within `timeout`
    (`socket.create_connection` bounds each address's connect, not the lookup)."""
    deadline = time.monotonic() + timeout
    error: OSError | None = None
    for family, kind, proto, _, addr in _resolve(host, port, timeout):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            sock.connect(addr)
            return sock
        except OSError as e:
            sock.close()
            error = e
        except BaseException:  # on any exit (Ctrl-C in connect()): the socket is closed
            sock.close()
            raise
    raise error or TimeoutError(f"connecting to {host}:{port} took longer than {timeout:g} s")


def command(*args: bytes) -> bytes:
    """A RESP array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class RespConnection:
    """One connection; not thread-safe (each tier thread owns one)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._sock: socket.socket | None = None
        self._buf = bytearray(_RECV_CHUNK)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._deadline = 0.0

    # ---- connection --------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self) -> None:
        ep = self.endpoint
        self._deadline = time.monotonic() + ep.connect_timeout_s + ep.io_timeout_s
        sock = None
        try:
            if ep.unix_path:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(ep.connect_timeout_s)
                sock.connect(ep.unix_path)
            else:
                sock = _connect_tcp(cast(str, ep.host), ep.port, ep.connect_timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUF)
            if ep.tls is not None:
                sock = ep.tls.wrap_socket(sock, server_hostname=ep.server_name or ep.host)
        except BaseException as e:  # on any exit: the socket is closed
            # Closed now, not when the error is freed: its traceback holds this frame,
            # and a log handler that keeps errors kept a socket per attempt.
            if sock is not None:
                sock.close()
            if not isinstance(e, (OSError, ssl.SSLError, UnicodeError)):
                raise  # UnicodeError: a name the resolver cannot encode (an Endpoint
                # built directly: the config refuses those)
            raise RespConnectionError(f"cannot connect to {ep.describe()}: {e}") from e
        self._sock = sock
        self._start = self._end = 0
        try:
            if ep.password is not None:
                auth: tuple[bytes, ...] = (b"AUTH",)
                if ep.username:
                    auth += (ep.username.encode(),)
                self.call(*auth, ep.password.encode())
            if ep.db:
                self.call(b"SELECT", str(ep.db).encode())
        except RespServerError as e:
            self.close()
            raise RespConnectionError(f"{ep.describe()} refused the session: {e}") from None

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def _fail(self, why: str, cause: BaseException | None = None) -> RespConnectionError:
        self.close()
        err = RespConnectionError(f"{self.endpoint.describe()}: {why}")
        err.timed_out = why == "timed out" or isinstance(cause, TimeoutError)
        if cause is not None:
            err.__cause__ = cause
        return err

    def unexpected(self, reply: object, command: str) -> RespConnectionError:
        """Closes the connection after a reply of the wrong type for `command` (the server
        and this client disagree about the stream: later replies cannot be trusted)."""
        return self._fail(f"unexpected reply {reply!r:.40} to {command}")

    def begin(self, timeout: float | None = None) -> None:
        """Starts a batch: every socket wait until the next `begin` shares one deadline."""
        self._deadline = time.monotonic() + (timeout or self.endpoint.io_timeout_s)

    def _arm(self) -> socket.socket:
        sock = self._sock
        if sock is None:
            raise RespConnectionError(f"{self.endpoint.describe()}: not connected")
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise self._fail("timed out")
        sock.settimeout(left)
        return sock

    # ---- sending -----------------------------------------------------------------------

    def send(self, parts: Sequence[Part]) -> None:
        """Sends the concatenation of `parts` (bytes-like) without joining them."""
        try:
            if self.endpoint.tls is not None:  # SSLSocket has no sendmsg
                for p in parts:
                    self._arm().sendall(p)
                return
            views = [memoryview(p).cast("B") for p in parts if len(p)]
            i = 0
            while i < len(views):
                batch = views[i : i + _IOV_MAX]
                sent = self._arm().sendmsg(batch)
                for v in batch:  # advance past what was sent, split a partial view
                    if sent >= len(v):
                        sent -= len(v)
                        i += 1
                    else:
                        views[i] = v[sent:]
                        break
        except (OSError, ssl.SSLError) as e:
            raise self._fail(f"send failed: {e}", e) from e

    # ---- receiving ---------------------------------------------------------------------

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        try:
            got = self._arm().recv_into(self._view[self._end :])
        except (OSError, ssl.SSLError) as e:
            raise self._fail(f"receive failed: {e}", e) from e
        if got == 0:
            raise self._fail("connection closed by the server")
        self._end += got

    def _line(self) -> bytes:
        while True:
            i = self._buf.find(_CRLF, self._start, self._end)
            if i >= 0:
                line = bytes(self._buf[self._start : i])
                self._start = i + 2
                return line
            if self._end - self._start >= len(self._buf) - 2:
                raise self._fail("reply line too long")
            self._fill()

    def read_into(self, out: memoryview) -> None:
        """Reads exactly `len(out)` bytes of the stream into `out` (buffered part first)."""
        n = len(out)
        have = min(n, self._end - self._start)
        out[:have] = self._view[self._start : self._start + have]
        self._start += have
        pos = have
        while pos < n:
            try:
                got = self._arm().recv_into(out[pos:])
            except (OSError, ssl.SSLError) as e:
                raise self._fail(f"receive failed: {e}", e) from e
            if got == 0:
                raise self._fail("connection closed by the server")
            pos += got

    def skip(self, n: int) -> None:
        """Discards `n` bytes of the stream."""
        while n:
            if self._start == self._end:
                self._fill()
            take = min(n, self._end - self._start)
            self._start += take
            n -= take

    def _number(self, text: bytes) -> int:
        """A RESP integer; anything else means the stream is not RESP: drop it."""
        digits = text[1:] if text[:1] == b"-" else text
        if not digits or len(digits) > _MAX_DIGITS or not digits.isdigit():
            raise self._fail(f"malformed number {text[:40]!r} in a reply")
        return int(text)

    def read_reply(self, *, max_items: int = _MAX_ARRAY) -> Reply:
        """One reply: str (+), int (:), bytes or None ($), list (*); an error reply (-)
        is returned as a `RespServerError`. A reply that is not well-formed RESP (or
        larger or deeper than any answer the tier asks for: arrays of more than
        `max_items` items in all, a cluster's slot map being the largest) closes the
        connection."""
        return self._reply(0, [max_items])

    def _reply(self, depth: int, budget: list[int]) -> Reply:
        line = self._line()
        if not line:
            raise self._fail("empty reply line")
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode(errors="replace")
        if kind == b"-":
            return RespServerError(rest.decode(errors="replace"))
        if kind == b":":
            return self._number(rest)
        if kind == b"$":
            n = self._number(rest)
            if n < 0:
                return None
            if n > _MAX_SMALL_BULK:
                raise self._fail(f"a reply of {n} bytes where a short answer belongs")
            data = bytearray(n + 2)
            self.read_into(memoryview(data))
            if data[n:] != _CRLF:
                raise self._fail("bulk reply without CRLF")
            return bytes(data[:n])
        if kind == b"*":
            n = self._number(rest)
            if n > budget[0] or depth >= _MAX_DEPTH:
                raise self._fail(f"an array reply of {n} items at depth {depth + 1}")
            budget[0] -= max(n, 0)
            return None if n < 0 else [self._reply(depth + 1, budget) for _ in range(n)]
        raise self._fail(f"unexpected reply {line[:40]!r}")

    def read_bulk_header(self) -> int | RespServerError:
        """Reads a bulk reply's length line: the length, -1 for nil, or the error."""
        line = self._line()
        if line[:1] == b"$":
            return self._number(line[1:])
        if line[:1] == b"-":
            return RespServerError(line[1:].decode(errors="replace"))
        raise self._fail(f"expected a bulk reply, got {line[:40]!r}")

    def end_bulk(self) -> None:
        crlf = bytearray(2)
        self.read_into(memoryview(crlf))
        if crlf != _CRLF:
            raise self._fail("bulk reply without CRLF")

    def call(self, *args: bytes) -> Reply:
        """Sends one command and returns its reply (an error reply raises)."""
        self.send([command(*args)])
        reply = self.read_reply()
        if isinstance(reply, RespServerError):
            raise reply
        return reply
