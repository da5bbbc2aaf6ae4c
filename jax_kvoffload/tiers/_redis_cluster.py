"""Where each key of the Redis tier goes: one server, or a Redis / Valkey Cluster's
primaries (docs/tiers.md, "Redis Cluster").

The router starts with every slot on the `url`'s node. `cluster="off"`: it stays so,
and a redirect is an error like any other. `cluster="auto"` (the default): the first
`-MOVED` / `-ASK` reply tells a cluster node from a standalone server (which never
sends one), and from then on keys are routed by hash slot. `cluster="on"` (or any
`seed_urls`): the slot map is read before the first command.

The map is read with `CLUSTER SHARDS` (`CLUSTER SLOTS` where the server does not know
it), asking the known primaries, then their replicas, then the seed nodes, skipping
nodes that are down; one thread at a time, at most every `REFRESH_INTERVAL_S`, within
`connect_timeout_s + io_timeout_s` in all (other threads go on with the map they have).
It is read again after a `-MOVED` (each one also patches its slot at once), a
`-CLUSTERDOWN`, a key of a slot no primary serves, and while a primary is down (a
failover promotes a replica: the map names it once the cluster has voted).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import cast

from jax_kvoffload._log_once import log_once
from jax_kvoffload.tiers._redis_nodes import NodeHealth
from jax_kvoffload.tiers._resp import (
    Endpoint,
    Reply,
    RespConnection,
    RespConnectionError,
    RespServerError,
    command,
)
from jax_kvoffload.tiers._slots import (
    MAX_NODES,
    SLOTS,
    Address,
    Redirect,
    SlotMap,
    SlotMapError,
    address_problem,
    is_loopback,
    key_slot,
    parse_shards,
    parse_slots,
)

__all__ = ["REFRESH_INTERVAL_S", "Router"]

logger = logging.getLogger("jax_kvoffload.tiers._redis")

# Often enough to find a promoted replica soon after the vote; rarely enough that a
# storm of redirects (a resharding, a hostile node) costs a few small replies a second.
REFRESH_INTERVAL_S = 0.5
# A slot map's reply: a range is 2 integers and each node a dozen fields.
_MAP_ITEMS = 4 * SLOTS + 32 * MAX_NODES


class Router:
    """The slot map of one tier, shared by its threads (thread-safe).

    Args:
      endpoint: how to reach `url`'s node; other nodes are reached the same way
        (credentials, TLS, timeouts) at their own host and port.
      mode: "auto", "on" or "off" (`RedisTierConfig.cluster`).
      seeds: `(host, port)` of the other seed nodes.
      key_prefix: the tier's key prefix (a `{hash tag}` in it is worth a warning).
    """

    def __init__(
        self,
        endpoint: Endpoint,
        mode: str,
        seeds: tuple[Address, ...],
        health: NodeHealth,
        key_prefix: str,
    ) -> None:
        self._endpoint = endpoint
        self.mode = mode
        # A unix socket is a standalone server's (the config refuses it with a cluster).
        self.seed: Address = (
            (endpoint.unix_path, 0)
            if endpoint.unix_path
            else (cast(str, endpoint.host), endpoint.port)
        )
        self.seeds = (self.seed, *seeds)
        self._loopback_only = all(is_loopback(host) for host, _ in self.seeds)
        self._health = health
        self._prefix = key_prefix
        self._map = SlotMap.single(self.seed)
        self.is_cluster = mode == "on"
        self._stale = self.is_cluster  # read the map before the first command
        self._lock = threading.Lock()
        self._refreshing = threading.Lock()
        self._next_refresh = 0.0
        self.refreshes = 0  # maps read and believed
        self.redirects = 0  # MOVED / ASK replies followed
        if self.is_cluster:
            self._warn_hash_tag()

    # ---- nodes -----------------------------------------------------------------------

    def endpoint(self, node: Address) -> Endpoint:
        if node == self.seed:
            return self._endpoint
        return dataclasses.replace(self._endpoint, host=node[0], port=node[1], unix_path=None)

    def describe(self, node: Address) -> str:
        return self.endpoint(node).describe()

    def connection(self, node: Address) -> RespConnection:
        return RespConnection(self.endpoint(node))

    @property
    def slot_map(self) -> SlotMap:
        return self._map

    def primaries(self) -> tuple[Address, ...]:
        return self._map.nodes

    # ---- routing ---------------------------------------------------------------------

    def route(self, rkey: bytes) -> Address | None:
        """The node serving `rkey` now; None: no primary serves its slot."""
        table = self._map
        if not self.is_cluster:
            return table.nodes[0]
        return table.node_of(key_slot(rkey))

    def follow(self, redirect: Redirect, at: Address) -> Address | None:
        """The node a redirect answered by `at` sends its key to; None where it is not
        followed (`cluster="off"`, or an address the tier must not reach)."""
        if self.mode == "off" or (redirect.host is None and at[1] == 0):
            return None
        node = (redirect.host or at[0], redirect.port)
        problem = address_problem(*node, loopback_only=self._loopback_only)
        if problem is not None:
            log_once(
                logger,
                "redis-redirect-refused",
                "redis tier: %s redirected a key to %s:%d, not followed: %s; such keys "
                "miss and their stores fail",
                self.describe(at),
                node[0],
                node[1],
                problem,
            )
            return None
        if not self.is_cluster:
            self._detected(at)
        with self._lock:
            self.redirects += 1
        if redirect.kind == "MOVED":
            self._stale = True
        return node

    def _detected(self, at: Address) -> None:
        self.is_cluster = True
        self._stale = True
        logger.info(
            "redis tier: %s is a cluster node; routing keys by hash slot", self.describe(at)
        )
        self._warn_hash_tag()

    def _warn_hash_tag(self) -> None:
        start = self._prefix.find("{")
        if start >= 0 and self._prefix.find("}", start + 1) > start + 1:
            log_once(
                logger,
                "redis-hash-tag",
                "redis tier: key_prefix %r holds a {hash tag}: every key hashes to one "
                "slot, so one node of the cluster holds them all; drop the braces",
                self._prefix,
            )

    def apply_moves(self, moves: dict[int, Address]) -> None:
        """Patches the map with the slots `-MOVED` replies named (until it is read again)."""
        if moves:
            with self._lock:
                self._map = self._map.moved(moves)

    def want_refresh(self) -> None:
        """The map may be wrong (a CLUSTERDOWN reply, a slot no primary serves)."""
        if self.is_cluster:
            self._stale = True

    # ---- the slot map ----------------------------------------------------------------

    def _due(self) -> bool:
        if not self.is_cluster or time.monotonic() < self._next_refresh:
            return False
        return self._stale or bool(self._health.down(self._map.nodes))

    def refresh(self) -> None:
        """Reads the slot map if it may have changed and no other thread is reading it;
        bounded (see the module docstring). A map that cannot be read or believed keeps
        the one the tier has."""
        if not self._due() or not self._refreshing.acquire(blocking=False):
            return
        try:
            if not self._due():
                return
            self._next_refresh = time.monotonic() + REFRESH_INTERVAL_S
            self._stale = False  # a redirect from now on asks again
            fresh = self._fetch()
            if fresh is None:
                self._stale = True
                return
            with self._lock:
                self._map = fresh
                self.refreshes += 1
        finally:
            self._refreshing.release()

    def _fetch(self) -> SlotMap | None:
        ep = self._endpoint
        deadline = time.monotonic() + ep.connect_timeout_s + ep.io_timeout_s
        known = self._map
        for node in dict.fromkeys((*known.nodes, *known.replicas, *self.seeds)):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if node[1] == 0 or not self._health.up(node):
                continue
            bounded = dataclasses.replace(
                self.endpoint(node),
                connect_timeout_s=min(ep.connect_timeout_s, left),
                io_timeout_s=left,
            )
            conn = RespConnection(bounded)
            try:
                try:
                    conn.connect()
                except RespConnectionError as e:
                    self._health.mark_down(node, e)
                    continue
                return self._ask(conn, node)
            except RespConnectionError as e:
                if e.timed_out:
                    self._health.mark_down(node, e)  # silent: data would wait on it too
                else:
                    self._bad_map(node, e)  # an answer that is no RESP: this reply's fault
            except SlotMapError as e:
                self._bad_map(node, e)
            finally:
                conn.close()
        log_once(
            logger,
            "redis-no-map",
            "redis tier: no node answered for the cluster's slot map; keys go where the "
            "last map said (or where redirects send them)",
        )
        return None

    def _bad_map(self, node: Address, err: Exception) -> None:
        log_once(
            logger,
            "redis-bad-map",
            "redis tier: the slot map from %s is not used: %s",
            self.describe(node),
            err,
        )

    def _ask(self, conn: RespConnection, node: Address) -> SlotMap:
        tls = self._endpoint.tls is not None
        reply = self._call(conn, b"SHARDS")
        if not isinstance(reply, RespServerError):
            return parse_shards(reply, node[0], tls=tls, loopback_only=self._loopback_only)
        reply = self._call(conn, b"SLOTS")  # a server before Redis 7
        if isinstance(reply, RespServerError):
            raise SlotMapError(f"CLUSTER SLOTS answered {reply}")
        return parse_slots(reply, node[0], loopback_only=self._loopback_only)

    @staticmethod
    def _call(conn: RespConnection, what: bytes) -> Reply:
        conn.begin()
        conn.send([command(b"CLUSTER", what)])
        return conn.read_reply(max_items=_MAP_ITEMS)
