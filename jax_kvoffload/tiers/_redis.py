"""RedisTier: a shared tier on a Redis-protocol server (Redis, Valkey), one key per chunk.

Key: `<key_prefix>:<namespace 16 hex>:<block hash hex>:<group>` (docs/tiers.md). Value:
the entry header (`_entry.py`, 68 + key bytes) followed by the payload; one `SET` writes
it whole (single-key writes are atomic on the server), one `GET` reads it whole, header
first, straight into the destination buffer, then the CRC32C is checked.

Several connections (one per I/O thread, loads and stores on separate ones) pipeline
batches of up to `batch_bytes`. A server that is down, slow or refuses writes means
misses and failed or dropped stores, never an exception to the caller: a failed
connection marks the server down for `retry_after_s` (doubling to 30 s while it stays
down), during which lookups and loads miss at once and stores are dropped; every
socket wait is bounded by `io_timeout_s`. Each kind of failure is logged once.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import ssl
import threading
import time
from collections.abc import Mapping, Sequence

from jax_kvoffload._log_once import log_once, reset_log_once
from jax_kvoffload.config import RedisTierConfig, TierConfigError
from jax_kvoffload.errors import KVOffloadTypeError
from jax_kvoffload.tiers._base import Buffer, SecondaryTier, TierJobResult
from jax_kvoffload.tiers._checks import check_items, check_keys
from jax_kvoffload.tiers._crc import crc32c, warn_if_slow
from jax_kvoffload.tiers._entry import check_header, encode_header, header_length
from jax_kvoffload.tiers._errors import buffer_size_error
from jax_kvoffload.tiers._job_runner import JobRunner
from jax_kvoffload.tiers._resp import (
    Endpoint,
    RespConnection,
    RespConnectionError,
    RespServerError,
    command,
)

__all__ = ["RedisTier", "redis_key"]

logger = logging.getLogger(__name__)

_MAX_RETRY_S = 30.0
_MAX_IDLE = 4  # connections kept for contains() calls from other threads
# The server-side key spells the last 4 bytes (the group index) as a number and the rest
# in hex: keys shorter than 4 bytes would collide (b"\x01" and b"\x00\x01").
_MIN_KEY_BYTES = 4


def redis_key(prefix: str, namespace: bytes, key: bytes) -> bytes:
    """`<prefix>:<namespace 16 hex>:<block hash hex>:<group index>`."""
    group = int.from_bytes(key[-4:], "big")
    return f"{prefix}:{namespace[:8].hex()}:{key[:-4].hex()}:{group}".encode()


def endpoint_from_config(config: RedisTierConfig) -> Endpoint:
    """The connection parameters of `config` (password from `password_env` if set)."""
    ep = config.endpoint
    password = ep["password"]
    if config.password_env:
        password = os.environ.get(config.password_env)
        if password is None:
            logger.warning(
                "redis tier: password_env=%s is not set in the environment; connecting "
                "without a password",
                config.password_env,
            )
    tls = None
    if ep["scheme"] == "rediss":
        key, value = "tls_ca_file", config.tls_ca_file
        try:
            tls = ssl.create_default_context(cafile=config.tls_ca_file)
            if config.tls_cert_file:
                key, value = "tls_cert_file", config.tls_cert_file
                tls.load_cert_chain(config.tls_cert_file, config.tls_key_file)
        except (OSError, ssl.SSLError) as e:
            raise TierConfigError(
                type(config).__name__,
                key,
                value,
                f"cannot be read as PEM ({e}); give a readable PEM file (tls_cert_file "
                "with tls_key_file, or one file holding both)",
            ) from None
        if not config.tls_verify:
            logger.warning("redis tier: tls_verify=false: the server's certificate is not checked")
            tls.check_hostname = False
            tls.verify_mode = ssl.CERT_NONE
    return Endpoint(
        host=ep["host"],
        port=ep["port"],
        unix_path=ep["path"],
        db=ep["db"],
        username=ep["username"],
        password=password,
        tls=tls,
        server_name=config.tls_server_name,
        connect_timeout_s=config.connect_timeout_s,
        io_timeout_s=config.io_timeout_s,
    )


def _in_sync(conn: RespConnection, batch, items, *args):
    """Runs `batch(conn, items, *args)`; an unexpected exception (the job runner fails the
    task) closes the connection, so the thread's next task never reads this one's replies."""
    try:
        return batch(conn, items, *args)
    except BaseException:
        conn.close()
        raise


class RedisTier(SecondaryTier):
    """The Redis-protocol secondary tier (contract: `SecondaryTier`; options:
    `RedisTierConfig`). Opening it does not need the server to be up."""

    medium = "remote"

    def __init__(
        self, config: RedisTierConfig, namespace: bytes, *, describe: Mapping | None = None
    ) -> None:
        super().__init__(namespace)  # `describe`: a server keeps no file beside the entries
        if not isinstance(config, RedisTierConfig):
            raise KVOffloadTypeError(
                f"config must be a RedisTierConfig, got {type(config).__name__}"
            )
        self.config = config
        warn_if_slow()
        self._endpoint = endpoint_from_config(config)
        self._where = self._endpoint.describe()
        self._health = threading.Lock()
        self._down_until = 0.0
        self._backoff = config.retry_after_s
        self._down = False
        self._idle: list[RespConnection] = []  # for contains(), any thread
        self._runner = JobRunner(
            "redis-tier",
            config.read_connections,
            config.write_connections,
            config.max_pending_store_bytes,
            self._counters,
            make_state=lambda kind: RespConnection(self._endpoint),
            close_state=lambda conn: conn.close(),
        )

    def _check_lookup_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        return check_keys(keys, min_bytes=_MIN_KEY_BYTES)

    def key_of(self, key: bytes) -> bytes:
        """The server-side key of an offload key."""
        return redis_key(self.config.key_prefix, self._namespace, key)

    # ---- health --------------------------------------------------------------------------

    def available(self) -> bool:
        """False while the server is considered down (within `retry_after_s`)."""
        return time.monotonic() >= self._down_until

    def _mark_down(self, err: Exception) -> None:
        self._counters.add(errors=1)
        now = time.monotonic()
        with self._health:
            if self._down and now < self._down_until:
                return  # another connection of the same outage: already down
            first = not self._down
            self._down = True
            self._down_until = now + self._backoff
            wait, self._backoff = self._backoff, min(2 * self._backoff, _MAX_RETRY_S)
        if first:
            reset_log_once(f"redis-up-{self._where}")
            log_once(
                logger,
                f"redis-down-{self._where}",
                "redis tier: %s failed (%s); "
                "lookups miss and stores are dropped, retrying in %.1f s",
                self._where,
                err,
                wait,
            )

    def _mark_up(self) -> None:
        if not self._down:
            return
        with self._health:
            was, self._down = self._down, False
            self._backoff = self.config.retry_after_s
        if was:
            reset_log_once(f"redis-down-{self._where}")
            logger.warning("redis tier: %s answers again", self._where)

    def _ready(self, conn: RespConnection) -> bool:
        """Connects `conn` if needed; False (and the server marked down) if it cannot."""
        if not self.available():
            return False
        if not conn.connected:
            try:
                conn.connect()
            except RespConnectionError as e:
                self._mark_down(e)
                return False
        return True

    # ---- public API --------------------------------------------------------------------

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        keys = check_keys(keys, min_bytes=_MIN_KEY_BYTES)
        out = [False] * len(keys)
        if keys:
            with self._health:
                conn = self._idle.pop() if self._idle else RespConnection(self._endpoint)
            reused = conn.connected

            def attempt() -> list[bool]:
                conn.begin()
                conn.send([command(b"EXISTS", self.key_of(k)) for k in keys])
                replies = [conn.read_reply() for _ in keys]
                for r in replies:
                    if not isinstance(r, (int, RespServerError)):
                        raise conn.unexpected(r, "EXISTS")
                return [r == 1 for r in replies]

            in_sync = False
            try:
                if self._ready(conn):
                    out = self._exchange(conn, reused, attempt)
                    self._mark_up()
                in_sync = True
            except RespConnectionError as e:
                self._mark_down(e)
                out = [False] * len(keys)
            finally:
                # Only a connection whose every reply was read goes back to the pool: one
                # left mid-reply would answer the next caller with a stale reply.
                with self._health:
                    keep = in_sync and conn.connected and len(self._idle) < _MAX_IDLE
                    if keep:
                        self._idle.append(conn)
                if not keep:
                    conn.close()
        self._counters.add(lookups=len(out), lookup_hits=sum(out))
        return out

    def submit_store(self, items: Sequence[tuple[bytes, Buffer]]) -> cf.Future[TierJobResult]:
        self._check_open()
        views = check_items(items, "items", min_bytes=_MIN_KEY_BYTES)
        self._counters.add(stores_submitted=1)
        tasks = [
            (a, b, lambda conn, a=a, b=b: _in_sync(conn, self._store_batch, views[a:b]))
            for a, b in self._batches([len(v) for _, v in views])
        ]
        nbytes = sum(len(v) for _, v in views)
        return self._runner.submit(
            "store", [k for k, _ in views], tasks, nbytes, accept=self.available
        )

    def submit_load(self, items: Sequence[tuple[bytes, Buffer]]) -> cf.Future[TierJobResult]:
        self._check_open()
        views = check_items(items, "items", writable=True, min_bytes=_MIN_KEY_BYTES)
        self._counters.add(loads_submitted=1)
        tasks = [
            (a, b, lambda conn, a=a, b=b: _in_sync(conn, self._load_batch, views[a:b], a))
            for a, b in self._batches([len(v) for _, v in views])
        ]
        return self._runner.submit("load", [k for k, _ in views], tasks, 0)

    def drain(self, timeout: float | None = None) -> bool:
        return self._runner.drain(timeout)

    def _close_io(self) -> None:
        self._runner.close()
        with self._health:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _batches(self, sizes: list[int]) -> list[tuple[int, int]]:
        # Runs of keys of at most batch_bytes each (at least one key), so one job spreads
        # over the connections and each pipelines a large batch.
        out, start, acc = [], 0, 0
        for i, n in enumerate(sizes):
            if i > start and acc + n > self.config.batch_bytes:
                out.append((start, i))
                start, acc = i, 0
            acc += n
        if start < len(sizes):
            out.append((start, len(sizes)))
        return out

    # ---- I/O ---------------------------------------------------------------------------

    def _exchange(self, conn: RespConnection, reused: bool, attempt):
        """`attempt()` (send a batch, read its replies) on `conn`; a reused connection
        that fails fast (reset, closed: the server restarted since its last use) is
        retried once on a fresh one. A timeout is not retried: the wait stays bounded."""
        try:
            return attempt()
        except RespConnectionError as e:
            if not reused or e.timed_out or not self._ready(conn):
                raise
            return attempt()

    def _store_batch(self, conn: RespConnection, items) -> tuple[list[bool], int]:
        reused = conn.connected
        if not self._ready(conn):
            self._counters.add(store_failures=len(items))
            return [False] * len(items), 0
        expiry = (b"EX", str(self.config.ttl_s).encode()) if self.config.ttl_s else ()
        parts: list = []
        for key, payload in items:
            rkey = self.key_of(key)
            header = encode_header(self._namespace, key, len(payload), crc32c(payload))
            nargs = 3 + len(expiry)
            tail = b"".join(b"\r\n$%d\r\n%s" % (len(a), a) for a in expiry)
            parts += [
                b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n"
                % (nargs, len(rkey), rkey, len(header) + len(payload)),
                header,
                payload,
                tail + b"\r\n",
            ]

        def attempt():
            conn.begin()
            conn.send(parts)
            replies = [conn.read_reply() for _ in items]
            for r in replies:
                if r != "OK" and not isinstance(r, RespServerError):
                    raise conn.unexpected(r, "SET")
            return replies

        try:
            replies = self._exchange(conn, reused, attempt)
        except RespConnectionError as e:
            self._mark_down(e)
            self._counters.add(store_failures=len(items))
            return [False] * len(items), 0
        self._mark_up()
        oks = [r == "OK" for r in replies]
        for r in replies:
            if isinstance(r, RespServerError):
                log_once(
                    logger,
                    f"redis-refused-{str(r)[:12]}",
                    "redis tier: %s refused a "
                    "store: %s; such stores fail (counted in stats().store_failures)",
                    self._where,
                    r,
                )
        moved = sum(len(p) for (_, p), ok in zip(items, oks, strict=True) if ok)
        self._counters.add(
            keys_stored=sum(oks), store_failures=len(oks) - sum(oks), bytes_written=moved
        )
        return oks, moved

    def _load_batch(self, conn: RespConnection, items, first: int):
        """Loads `items` (the job's from index `first` on): per key verified or not, the
        bytes moved, and the first buffer of the wrong length (a caller's error)."""
        oks = [False] * len(items)
        sizes: dict[int, int] = {}  # item -> stored payload length its buffer does not fit
        reused = conn.connected
        if not self._ready(conn):
            self._counters.add(load_misses=len(items))
            return oks, 0
        try:
            self._exchange(conn, reused, lambda: self._get_batch(conn, items, oks, sizes))
        except RespConnectionError as e:
            self._mark_down(e)  # keys read before the failure were verified: they stay hits
        else:
            self._mark_up()
        moved = sum(len(out) for (_, out), ok in zip(items, oks, strict=True) if ok)
        self._counters.add(load_hits=sum(oks), load_misses=len(oks) - sum(oks), bytes_read=moved)
        if sizes:
            i, stored = min(sizes.items())
            return oks, moved, buffer_size_error(first + i, len(items[i][1]), stored, self._where)
        return oks, moved

    def _get_batch(self, conn: RespConnection, items, oks: list[bool], sizes: dict) -> None:
        """One pipelined GET of every item; sets `oks[i]` for each verified hit and
        `sizes[i]` for a whole entry that item i's buffer does not fit."""
        oks[:] = [False] * len(items)
        sizes.clear()
        bad: list[bytes] = []
        conn.begin()
        conn.send([command(b"GET", self.key_of(k)) for k, _ in items])
        for i, (key, out) in enumerate(items):
            reason = self._read_value(conn, key, out)
            if reason is None:
                oks[i] = True
            elif isinstance(reason, int):  # kept: the caller's buffer is the wrong size
                sizes[i] = reason
            elif isinstance(reason, RespServerError):  # e.g. an ACL denial: not the entry
                log_once(
                    logger,
                    f"redis-get-{str(reason)[:12]}",
                    "redis tier: %s refused a load: %s; such loads miss",
                    self._where,
                    reason,
                )
            elif reason != "absent":
                bad.append(key)
                self._counters.add(corrupt=1)
                log_once(
                    logger,
                    "redis-corrupt",
                    "redis tier: removed a bad entry (%s) "
                    "at %s; further ones are counted in stats().corrupt",
                    reason,
                    self.key_of(key).decode(),
                )
        if bad:  # a concurrent rewrite may be lost: a future miss, never a wrong byte
            conn.send([command(b"DEL", *[self.key_of(k) for k in bad])])
            reply = conn.read_reply()
            if not isinstance(reply, (int, RespServerError)):
                raise conn.unexpected(reply, "DEL")

    def _read_value(
        self, conn: RespConnection, key: bytes, out: memoryview
    ) -> str | int | RespServerError | None:
        """Reads one GET reply into `out`; None if it is a verified hit, else why not (the
        server's error reply, "absent", what is wrong with the stored value, or, as an
        int, the payload length of a whole entry that `out` does not fit)."""
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
            hdr = check_header(head, namespace=self._namespace, key=key)
            if not isinstance(hdr, str) and hdr.payload_len == n - hlen:
                return hdr.payload_len
            return f"value of {n} bytes for a payload of {len(out)}"
        head = bytearray(hlen)
        conn.read_into(memoryview(head))
        hdr = check_header(head, namespace=self._namespace, key=key, payload_len=len(out))
        if isinstance(hdr, str):
            conn.skip(len(out))
            conn.end_bulk()
            return hdr
        conn.read_into(out)
        conn.end_bulk()
        if crc32c(out) != hdr.payload_crc:
            return "payload checksum mismatch"
        return None
