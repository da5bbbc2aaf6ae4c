"""RedisTier: a shared tier on a Redis-protocol server (Redis, Valkey), standalone or a
Cluster, one key per chunk.

Key: `<key_prefix>:<namespace 16 hex>:<block hash hex>:<group>` (docs/tiers.md). Value:
the entry header followed by the payload (`_redis_ops.py`): one `SET` writes it whole,
one `GET` reads it whole, header first, straight into the destination buffer, then the
CRC32C is checked.

Several connections per node (one per I/O thread, loads and stores on separate ones)
pipeline batches of up to `batch_bytes`; on a cluster a batch splits into one pipeline
per node (`_redis_exchange.py`), routed by hash slot (`_redis_cluster.py`). A node that
is down, slow or refuses writes means misses and failed or dropped stores, never an
exception to the caller: a failed connection marks that node down for `retry_after_s`
(doubling to 30 s while it stays down), during which its keys miss at once and stores
to it fail (all of them dropped at submission when no node is up); every socket wait is
bounded by `io_timeout_s`. Each kind of failure is logged once.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import ssl
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jax_kvoffload._log_once import log_once
from jax_kvoffload.config import RedisTierConfig, TierConfigError
from jax_kvoffload.errors import KVOffloadTypeError
from jax_kvoffload.tiers._base import Buffer, SecondaryTier, TierJobResult
from jax_kvoffload.tiers._checks import check_items, check_keys
from jax_kvoffload.tiers._crc import warn_if_slow
from jax_kvoffload.tiers._errors import buffer_size_error
from jax_kvoffload.tiers._job_runner import JobRunner, TaskResult, byte_runs
from jax_kvoffload.tiers._redis_cluster import Router
from jax_kvoffload.tiers._redis_exchange import Exchange, ItemReply, Op
from jax_kvoffload.tiers._redis_nodes import NodeHealth, NodeLinks
from jax_kvoffload.tiers._redis_ops import ExistsOp, GetOp, SetOp, is_bad
from jax_kvoffload.tiers._resp import Endpoint, RespServerError
from jax_kvoffload.tiers._slots import Address

__all__ = ["RedisTier", "RedisTopology", "redis_key"]

logger = logging.getLogger(__name__)

_MAX_IDLE = 4  # connection sets kept for contains() calls from other threads
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


@dataclass(frozen=True)
class RedisTopology:
    """What a Redis tier knows of its server(s) now (`RedisTier.topology()`).

    Attributes:
      cluster: whether keys are routed by hash slot (a cluster, configured or detected).
      slots: primaries `"host:port"` -> the number of hash slots each serves (one node
        with all 16384 for a standalone server).
      down: the nodes (primaries or not) that failed and have not answered since.
      map_refreshes: slot maps read and believed since the tier was opened.
      redirects: `-MOVED` / `-ASK` replies followed.
    """

    cluster: bool
    slots: dict[str, int]
    down: tuple[str, ...]
    map_refreshes: int
    redirects: int


class _Thread:
    """One I/O thread's connections and the exchange running on them."""

    def __init__(self, tier: RedisTier) -> None:
        self.links = NodeLinks(tier._router.connection)
        self.exchange = Exchange(tier._router, tier._health, self.links)

    def run(self, op: Op, rkeys: list[bytes]) -> list[ItemReply]:
        """`exchange.run`; an unexpected exception (the job runner fails the task) closes
        the connections, so the thread's next task never reads this one's replies."""
        try:
            return self.exchange.run(op, rkeys)
        except BaseException:  # on any exit: no half-read connection is reused
            self.links.close()
            raise


class RedisTier(SecondaryTier):
    """The Redis-protocol secondary tier (contract: `SecondaryTier`; options:
    `RedisTierConfig`). Opening it does not need the server to be up."""

    medium = "remote"

    def __init__(
        self,
        config: RedisTierConfig,
        namespace: bytes,
        *,
        describe: Mapping[str, object] | None = None,
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
        self._health = NodeHealth(config.retry_after_s, self._counters, self._describe)
        self._router = Router(
            self._endpoint,
            config.cluster,
            config.seed_addresses,
            self._health,
            config.key_prefix,
        )
        self._idle_lock = threading.Lock()
        self._idle: list[_Thread] = []  # for contains(), any thread
        self._runner = JobRunner(
            "redis-tier",
            config.read_connections,
            config.write_connections,
            config.max_pending_store_bytes,
            self._counters,
            make_state=lambda kind: _Thread(self),
            close_state=lambda state: state.links.close(),
        )

    def _describe(self, node: Address) -> str:
        return self._router.describe(node)

    def _check_lookup_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        return check_keys(keys, min_bytes=_MIN_KEY_BYTES)

    def key_of(self, key: bytes) -> bytes:
        """The server-side key of an offload key."""
        return redis_key(self.config.key_prefix, self._namespace, key)

    # ---- health --------------------------------------------------------------------------

    def available(self) -> bool:
        """False while every primary and seed node is considered down (within
        `retry_after_s`): stores are then dropped at submission."""
        return self._health.any_up((*self._router.primaries(), *self._router.seeds))

    def topology(self) -> RedisTopology:
        """The slot map in use, the nodes down, and how often the map changed."""
        router = self._router
        return RedisTopology(
            cluster=router.is_cluster,
            slots={f"{h}:{p}": n for (h, p), n in router.slot_map.slot_counts().items()},
            down=tuple(f"{h}:{p}" for h, p in self._health.down(self._health.known())),
            map_refreshes=router.refreshes,
            redirects=router.redirects,
        )

    # ---- public API --------------------------------------------------------------------

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        keys = check_keys(keys, min_bytes=_MIN_KEY_BYTES)
        out = [False] * len(keys)
        if keys:
            with self._idle_lock:
                state = self._idle.pop() if self._idle else _Thread(self)
            in_sync = False
            try:
                rkeys = [self.key_of(k) for k in keys]
                replies = state.exchange.run(ExistsOp(rkeys), rkeys)
                out = [r == 1 for r in replies]
                in_sync = True
            finally:
                # Only connections whose every reply was read go back to the pool: one
                # left mid-reply would answer the next caller with a stale reply.
                with self._idle_lock:
                    keep = in_sync and state.links.connected and len(self._idle) < _MAX_IDLE
                    if keep:
                        self._idle.append(state)
                if not keep:
                    state.links.close()
        self._counters.add(lookups=len(out), lookup_hits=sum(out))
        return out

    def submit_store(self, items: Sequence[tuple[bytes, Buffer]]) -> cf.Future[TierJobResult]:
        self._check_open()
        views = check_items(items, "items", min_bytes=_MIN_KEY_BYTES)
        self._counters.add(stores_submitted=1)
        tasks = [
            (a, b, lambda state, a=a, b=b: self._store_batch(state, views[a:b]))
            for a, b in byte_runs([len(v) for _, v in views], self.config.batch_bytes)
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
            (a, b, lambda state, a=a, b=b: self._load_batch(state, views[a:b], a))
            for a, b in byte_runs([len(v) for _, v in views], self.config.batch_bytes)
        ]
        return self._runner.submit("load", [k for k, _ in views], tasks, 0)

    def drain(self, timeout: float | None = None) -> bool:
        return self._runner.drain(timeout)

    def _close_io(self) -> None:
        self._runner.close()
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for state in idle:
            state.links.close()

    # ---- I/O ---------------------------------------------------------------------------

    def _store_batch(
        self, state: _Thread, items: Sequence[tuple[bytes, memoryview]]
    ) -> tuple[list[bool], int]:
        rkeys = [self.key_of(k) for k, _ in items]
        replies = state.run(SetOp(self._namespace, rkeys, items, self.config.ttl_s), rkeys)
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

    def _load_batch(
        self, state: _Thread, items: Sequence[tuple[bytes, memoryview]], first: int
    ) -> TaskResult:
        """Loads `items` (the job's from index `first` on): per key verified or not, the
        bytes moved, and the first buffer of the wrong length (a caller's error)."""
        rkeys = [self.key_of(k) for k, _ in items]
        replies = state.run(GetOp(self._namespace, rkeys, items), rkeys)
        oks = [r is None for r in replies]
        sizes = {i: r for i, r in enumerate(replies) if isinstance(r, int)}
        for r, rkey in zip(replies, rkeys, strict=True):
            if isinstance(r, RespServerError):  # e.g. an ACL denial: not the entry
                log_once(
                    logger,
                    f"redis-get-{str(r)[:12]}",
                    "redis tier: %s refused a load: %s; such loads miss",
                    self._where,
                    r,
                )
            elif is_bad(r):
                self._counters.add(corrupt=1)
                log_once(
                    logger,
                    "redis-corrupt",
                    "redis tier: removed a bad entry (%s) "
                    "at %s; further ones are counted in stats().corrupt",
                    r,
                    rkey.decode(),
                )
        moved = sum(len(out) for (_, out), ok in zip(items, oks, strict=True) if ok)
        self._counters.add(load_hits=sum(oks), load_misses=len(oks) - sum(oks), bytes_read=moved)
        if sizes:
            i, stored = min(sizes.items())
            return oks, moved, buffer_size_error(first + i, len(items[i][1]), stored, self._where)
        return oks, moved
