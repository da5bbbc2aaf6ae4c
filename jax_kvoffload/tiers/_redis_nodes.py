"""The Redis tier's view of its nodes: which answer (with back-off for those that do
not), and each I/O thread's connections to them.

A standalone server is one node; a cluster's primaries are several. A node that fails
(refused, reset, timed out, a session it refuses) is down for `retry_after_s`, doubling
to 30 s while it stays down: its keys miss and their stores fail at once instead of
waiting on it again. Each outage is logged once, and once more when the node answers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from jax_kvoffload._log_once import log_once, reset_log_once
from jax_kvoffload.tiers._base import Counters
from jax_kvoffload.tiers._resp import RespConnection, RespConnectionError
from jax_kvoffload.tiers._slots import Address

__all__ = ["NodeHealth", "NodeLinks"]

logger = logging.getLogger("jax_kvoffload.tiers._redis")

_MAX_RETRY_S = 30.0
_MAX_TRACKED = 4096  # nodes whose outage is remembered


class _State:
    __slots__ = ("backoff", "down", "until")

    def __init__(self, backoff: float) -> None:
        self.down = False
        self.until = 0.0
        self.backoff = backoff


class NodeHealth:
    """Up or down, per node; thread-safe. `describe(node)` names a node in messages."""

    def __init__(
        self, retry_after_s: float, counters: Counters, describe: Callable[[Address], str]
    ) -> None:
        self._retry = retry_after_s
        self._counters = counters
        self._describe = describe
        self._lock = threading.Lock()
        self._nodes: dict[Address, _State] = {}

    def up(self, node: Address) -> bool:
        """False while `node` is considered down (within its back-off)."""
        state = self._nodes.get(node)
        return state is None or time.monotonic() >= state.until

    def any_up(self, nodes: Iterable[Address]) -> bool:
        return any(self.up(n) for n in nodes)

    def known(self) -> list[Address]:
        """The nodes that failed and have not answered since."""
        with self._lock:
            return list(self._nodes)

    def down(self, nodes: Iterable[Address]) -> list[Address]:
        """Those of `nodes` that failed and have not answered since (back-off over or not)."""
        return [n for n in nodes if (s := self._nodes.get(n)) is not None and s.down]

    def mark_down(self, node: Address, err: Exception) -> None:
        self._counters.add(errors=1)
        now = time.monotonic()
        where = self._describe(node)
        with self._lock:
            if node not in self._nodes and len(self._nodes) >= _MAX_TRACKED:
                # Redirects to ever new addresses (a hostile node): forget expired ones.
                for old in [n for n, st in self._nodes.items() if st.until <= now]:
                    del self._nodes[old]
            state = self._nodes.setdefault(node, _State(self._retry))
            if state.down and now < state.until:
                return  # another connection of the same outage: already down
            first = not state.down
            state.down = True
            state.until = now + state.backoff
            wait, state.backoff = state.backoff, min(2 * state.backoff, _MAX_RETRY_S)
        if first:
            reset_log_once(f"redis-up-{where}")
            log_once(
                logger,
                f"redis-down-{where}",
                "redis tier: %s failed (%s); lookups of its keys miss and stores to it "
                "fail or are dropped, retrying in %.1f s",
                where,
                err,
                wait,
            )

    def mark_up(self, node: Address) -> None:
        state = self._nodes.get(node)
        if state is None or not state.down:
            return
        with self._lock:
            was = state.down
            self._nodes.pop(node, None)  # up: nothing to remember (the back-off restarts)
        if was:
            reset_log_once(f"redis-down-{self._describe(node)}")
            logger.warning("redis tier: %s answers again", self._describe(node))

    def ready(self, node: Address, conn: RespConnection) -> bool:
        """Connects `conn` to `node` if needed; False (and the node marked down) if the
        node is down or cannot be reached."""
        if not self.up(node):
            return False
        if not conn.connected:
            try:
                conn.connect()
            except RespConnectionError as e:
                self.mark_down(node, e)
                return False
        return True


class NodeLinks:
    """One thread's connections, one per node it talked to; not thread-safe (each I/O
    thread, and each `contains()` call, holds its own). `connect_to(node)` makes the
    connection object of a node (the router's endpoint for it)."""

    def __init__(self, connect_to: Callable[[Address], RespConnection]) -> None:
        self._connect_to = connect_to
        self._conns: dict[Address, RespConnection] = {}

    def get(self, node: Address) -> RespConnection:
        conn = self._conns.get(node)
        if conn is None:
            conn = self._conns[node] = self._connect_to(node)
        return conn

    def keep_only(self, nodes: Iterable[Address]) -> None:
        """Closes the connections to nodes not in `nodes` (gone from the slot map)."""
        keep = set(nodes)
        for node in [n for n in self._conns if n not in keep]:
            self._conns.pop(node).close()

    @property
    def connected(self) -> bool:
        """Whether any connection is open."""
        return any(c.connected for c in self._conns.values())

    def __len__(self) -> int:
        return len(self._conns)

    def close(self) -> None:
        conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            conn.close()
