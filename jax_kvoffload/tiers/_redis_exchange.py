"""One pipelined batch of the Redis tier, over the nodes its keys live on.

The batch's keys are grouped by node (one group on a standalone server). Every group is
sent before any reply is read, so the nodes work at once; then each group's replies are
read in turn, each node within its own `io_timeout_s` (a batch waits at most that long
for each node that does not answer, and that node is then down for `retry_after_s`).

A key answered `-MOVED` is sent again to the node named (its slot patched in the map),
one answered `-ASK` to the node named, after `ASKING`, for this command only; a key is
sent at most `MAX_ROUNDS` times, so two nodes redirecting to each other end the batch
(that key fails) instead of looping. A reused connection that fails fast (reset: the
server restarted since its last batch) is tried once more on a fresh connection; a
timeout is not retried.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TypeAlias

from jax_kvoffload._log_once import log_once
from jax_kvoffload.tiers._redis_cluster import Router, logger
from jax_kvoffload.tiers._redis_nodes import NodeHealth, NodeLinks
from jax_kvoffload.tiers._resp import (
    Part,
    Reply,
    RespConnection,
    RespConnectionError,
    RespServerError,
    command,
)
from jax_kvoffload.tiers._slots import Address, parse_redirect

__all__ = ["FAILED", "MAX_ROUNDS", "Exchange", "ItemReply", "Op"]

# Jedis' default (maxAttempts=5); redis-py allows 16. A key that moves more often than
# that within one batch is in a redirect loop, not in a resharding.
MAX_ROUNDS = 5
_ASKING = command(b"ASKING")


class _Failed:
    """The reply of a key whose node is down, unreachable, or serves no slot of it."""

    def __repr__(self) -> str:
        return "FAILED"


FAILED = _Failed()
# An item's outcome in `Exchange.run`: its node's reply, or FAILED.
ItemReply: TypeAlias = Reply | _Failed


class Op(ABC):
    """One command kind over a batch of items (SET, GET, EXISTS)."""

    name: str = ""

    @abstractmethod
    def parts(self, i: int) -> list[Part]:
        """The command of item `i`, as buffers sent without joining them."""

    @abstractmethod
    def read(self, conn: RespConnection, i: int) -> Reply:
        """Reads item `i`'s reply: the answer, or the server's `RespServerError`."""

    def after(self, conn: RespConnection, items: list[int], replies: list[Reply]) -> None:
        """Runs on the node just read, once every reply of `items` was read."""
        del conn, items, replies


class Exchange:
    """Runs ops over the router's nodes on one thread's connections (`links`)."""

    def __init__(self, router: Router, health: NodeHealth, links: NodeLinks) -> None:
        self._router = router
        self._health = health
        self._links = links

    def run(self, op: Op, rkeys: list[bytes]) -> list[ItemReply]:
        """Per item: the reply its node gave last (after redirects), or FAILED."""
        out: list[ItemReply] = [FAILED] * len(rkeys)
        todo = list(range(len(rkeys)))
        asks: dict[int, Address] = {}
        for _ in range(MAX_ROUNDS):
            self._router.refresh()
            groups: dict[tuple[Address, bool], list[int]] = {}
            for i in todo:
                node = asks.get(i) or self._router.route(rkeys[i])
                if node is None:
                    self._unserved()
                    continue
                groups.setdefault((node, i in asks), []).append(i)
            sent: list[tuple[Address, bool, list[int], list[Part], RespConnection, bool]] = []
            for (node, asking), items in groups.items():
                parts = self._parts(op, items, asking)
                got = self._send(node, parts)
                if got is not None:
                    sent.append((node, asking, items, parts, *got))
            moves: dict[int, Address] = {}
            todo, asks = [], {}
            for node, asking, items, parts, conn, retry in sent:
                replies = self._read(node, conn, retry, parts, op, items, asking)
                for i, reply in zip(items, replies, strict=True):
                    out[i] = reply
                    if isinstance(reply, RespServerError):
                        target = self._redirect(reply, node, moves)
                        if target is not None:
                            todo.append(i)
                            if target[1]:
                                asks[i] = target[0]
            self._router.apply_moves(moves)
            if not todo:
                break
        else:
            log_once(
                logger,
                "redis-redirect-loop",
                "redis tier: a key was redirected %d times in one batch (a redirect loop); "
                "such keys miss and their stores fail",
                MAX_ROUNDS,
            )
        if len(self._links) > len(self._router.primaries()) + 2:
            self._links.keep_only(self._router.primaries())
        return out

    def _unserved(self) -> None:
        self._router.want_refresh()
        log_once(
            logger,
            "redis-unserved",
            "redis tier: a key's hash slot is served by no primary in the cluster's map; "
            "such keys miss and their stores fail",
        )

    def _redirect(
        self, reply: RespServerError, node: Address, moves: dict[int, Address]
    ) -> tuple[Address, bool] | None:
        """Where a redirect reply sends its key (and whether with ASKING), or None."""
        text = str(reply)
        if text.startswith("CLUSTERDOWN"):
            self._router.want_refresh()
            return None
        redirect = parse_redirect(text)
        if redirect is None:
            return None
        target = self._router.follow(redirect, node)
        if target is None:
            return None
        if redirect.kind == "MOVED":
            moves[redirect.slot] = target
            return target, False
        return target, True

    @staticmethod
    def _parts(op: Op, items: list[int], asking: bool) -> list[Part]:
        parts: list[Part] = []
        for i in items:
            if asking:
                parts.append(_ASKING)
            parts += op.parts(i)
        return parts

    def _send(self, node: Address, parts: list[Part]) -> tuple[RespConnection, bool] | None:
        """Sends a group; `(connection, whether a fast failure may be retried)`, or None
        if the node is down or the send failed (the node is then down)."""
        conn = self._links.get(node)
        retry = conn.connected  # a reused connection may have been reset meanwhile
        if not self._health.ready(node, conn):
            return None
        while True:
            try:
                conn.begin()
                conn.send(parts)
                return conn, retry
            except RespConnectionError as e:
                if not retry or e.timed_out:
                    self._health.mark_down(node, e)
                    return None
            retry = False  # reset: the server restarted since; once more, on a fresh one
            if not self._health.ready(node, conn):
                return None

    def _read(
        self,
        node: Address,
        conn: RespConnection,
        retry: bool,
        parts: list[Part],
        op: Op,
        items: list[int],
        asking: bool,
    ) -> Sequence[ItemReply]:
        """The replies of a sent group; FAILED for those not read (the node failed:
        replies read before the failure stand)."""
        replies: list[Reply] = []
        try:
            self._read_group(conn, op, items, asking, replies)
        except RespConnectionError as e:
            if not retry or e.timed_out:
                self._health.mark_down(node, e)
                return replies + [FAILED] * (len(items) - len(replies))
            if not self._health.ready(node, conn):
                return replies + [FAILED] * (len(items) - len(replies))
            replies = []
            try:
                conn.begin()
                conn.send(parts)
                self._read_group(conn, op, items, asking, replies)
            except RespConnectionError as e2:
                self._health.mark_down(node, e2)
                return replies + [FAILED] * (len(items) - len(replies))
        self._health.mark_up(node)
        return replies

    @staticmethod
    def _read_group(
        conn: RespConnection, op: Op, items: list[int], asking: bool, replies: list[Reply]
    ) -> None:
        conn.begin()  # each node its own deadline: one that timed out costs the others none
        for i in items:
            if asking:
                ok = conn.read_reply()
                if not isinstance(ok, (str, RespServerError)):
                    raise conn.unexpected(ok, "ASKING")
            replies.append(op.read(conn, i))
        op.after(conn, items, replies)
