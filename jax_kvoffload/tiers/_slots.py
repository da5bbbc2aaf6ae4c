"""Redis Cluster's key space: hash slots, the slot map, and the replies that change it.

A cluster splits its keys over 16384 hash slots, each served by one primary (the Redis
Cluster specification): slot = CRC16/XMODEM(key) mod 16384, where a key holding a
`{hash tag}` (the bytes between its first `{` and the next `}`, if any) hashes that tag
alone. `binascii.crc_hqx(data, 0)` is that CRC16 (polynomial 0x1021, initial value 0:
check value 0x31C3 for b"123456789"), in C.

The map is read from `CLUSTER SHARDS` (Redis 7+, Valkey) or `CLUSTER SLOTS` (older
servers), and patched by `-MOVED <slot> <host>:<port>` replies in between. Every reply is
checked here before it is believed: a slot map that is not well formed, names a slot
twice or no slot at all, or sends the tier to an address it must not reach is refused
whole (`SlotMapError`; the tier keeps the map it had).
"""

from __future__ import annotations

import array
import binascii
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "SLOTS",
    "Address",
    "Redirect",
    "SlotMap",
    "SlotMapError",
    "address_problem",
    "key_slot",
    "parse_redirect",
    "parse_shards",
    "parse_slots",
]

SLOTS = 16384
_NONE = 0xFFFF  # a slot no reachable primary serves
# Redis documents clusters of up to ~1000 nodes; a map naming more is not one.
MAX_NODES = 1024
_LOOPBACK_NAMES = ("localhost", "localhost.", "localhost.localdomain")
_NAME = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9_-]{1,63}(?<!-))*\.?$")

Address = tuple[str, int]  # (host, port) of a node


class SlotMapError(ValueError):
    """A cluster's answer about its slots cannot be used; the message says why."""


def key_slot(key: bytes) -> int:
    """The hash slot of `key` (its `{hash tag}` alone where it has one)."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return binascii.crc_hqx(key, 0) & (SLOTS - 1)


def is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def address_problem(host: str, port: int, *, loopback_only: bool) -> str | None:
    """Why the tier must not connect to a node announced at `host:port`, or None.

    Refused: what is no host (bad syntax, an unspecified or multicast address), a port
    outside 1..65535, and, for a tier whose seed nodes are all on loopback, any other
    machine: a loopback cluster that names another host is misconfigured or hostile,
    and the tier would send users' KV bytes there.
    """
    if not isinstance(port, int) or not 0 < port < 65536:
        return f"port {port!r} is not in 1..65535"
    if not isinstance(host, str) or not host.isascii():
        return f"host {host!r:.80} is not an ASCII host name or address"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if len(host) > 253 or not _NAME.match(host):
            return f"host {host!r:.80} is no host name or address"
        ip = None
    if ip is not None and (ip.is_unspecified or ip.is_multicast):
        return f"host {host} is not a node's address (unspecified or multicast)"
    if loopback_only and not is_loopback(host):
        return (
            f"host {host!r:.80} is not on loopback, but every seed node is: a loopback "
            "cluster does not announce other machines"
        )
    return None


@dataclass(frozen=True)
class SlotMap:
    """Which primary serves each slot. Immutable: a change makes a new map.

    Attributes:
      nodes: the primaries, (host, port) each.
      table: per slot, the index of its primary in `nodes` (0xFFFF: none).
      replicas: other nodes the cluster named (asked for the map when primaries fail).
    """

    nodes: tuple[Address, ...]
    table: array.array[int]
    replicas: tuple[Address, ...] = ()

    @classmethod
    def single(cls, node: Address) -> SlotMap:
        """Every slot on one node: a standalone server, or a cluster not yet asked."""
        return cls((node,), array.array("H", bytes(2 * SLOTS)))

    @classmethod
    def from_ranges(
        cls, ranges: Iterable[tuple[int, int, Address]], replicas: Iterable[Address] = ()
    ) -> SlotMap:
        """The map of `(first slot, last slot, primary)` ranges; a slot named twice, or
        none at all, is refused."""
        table = array.array("H", [_NONE]) * SLOTS
        nodes: dict[Address, int] = {}
        for first, last, node in ranges:
            index = nodes.setdefault(node, len(nodes))
            if len(nodes) > MAX_NODES:
                raise SlotMapError(f"more than {MAX_NODES} primaries")
            for slot in range(first, last + 1):
                if table[slot] != _NONE and table[slot] != index:
                    raise SlotMapError(f"slot {slot} has two primaries")
                table[slot] = index
        if not nodes:
            raise SlotMapError("no slot is served")
        others = tuple(dict.fromkeys(r for r in replicas if r not in nodes))[:MAX_NODES]
        return cls(tuple(nodes), table, others)

    def node_of(self, slot: int) -> Address | None:
        index = self.table[slot]
        return None if index == _NONE else self.nodes[index]

    def moved(self, moves: dict[int, Address]) -> SlotMap:
        """This map with each `slot` of `moves` served by its new primary."""
        nodes = list(self.nodes)
        table = array.array("H", self.table)
        for slot, node in moves.items():
            if node not in nodes:
                if len(nodes) >= MAX_NODES:
                    continue  # a redirect storm to ever new addresses: not believed
                nodes.append(node)
            table[slot] = nodes.index(node)
        return SlotMap(tuple(nodes), table, self.replicas)

    def slot_counts(self) -> dict[Address, int]:
        """Slots per primary (primaries without slots left out)."""
        counts = [0] * len(self.nodes)
        for index in self.table:
            if index != _NONE:
                counts[index] += 1
        return {n: c for n, c in zip(self.nodes, counts, strict=True) if c}


@dataclass(frozen=True)
class Redirect:
    """A `-MOVED` (the slot lives elsewhere now) or `-ASK` (this key, this once, while
    its slot migrates) reply. `host` None: the host of the node that answered."""

    kind: str
    slot: int
    host: str | None
    port: int


def parse_redirect(message: str) -> Redirect | None:
    """The redirect an error reply's text holds, or None (another error, or a malformed
    redirect, which is then an error like any other)."""
    parts = message.split(" ")
    if len(parts) != 3 or parts[0] not in ("MOVED", "ASK"):
        return None
    kind, slot_text, where = parts
    host, sep, port_text = where.rpartition(":")
    if not (slot_text.isascii() and slot_text.isdigit() and len(slot_text) <= 5):
        return None
    if not (sep and port_text.isascii() and port_text.isdigit() and len(port_text) <= 5):
        return None
    slot, port = int(slot_text), int(port_text)
    if slot >= SLOTS or not 0 < port < 65536:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return Redirect(kind, slot, host or None, port)


# ---- CLUSTER SHARDS / CLUSTER SLOTS ------------------------------------------------------


def _text(value: object, what: str) -> str:
    if not isinstance(value, bytes):
        raise SlotMapError(f"{what} is {type(value).__name__}, not a string")
    try:
        return value.decode("ascii")
    except UnicodeDecodeError:
        raise SlotMapError(f"{what} {value!r:.60} is not ASCII") from None


def _int(value: object, what: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise SlotMapError(f"{what} {value!r:.40} is not an integer in {low}..{high}")
    return value


def _flat_map(value: object, what: str) -> dict[str, object]:
    if not isinstance(value, list) or len(value) % 2:
        raise SlotMapError(f"{what} is not a list of name/value pairs")
    return {_text(value[i], f"a name in {what}"): value[i + 1] for i in range(0, len(value), 2)}


def _endpoint(value: object, asked: str) -> str | None:
    """A node's preferred endpoint: NULL or "" mean the host the map came from (Redis'
    CLUSTER SLOTS documentation); "?" an endpoint the cluster does not know (None)."""
    if value is None or value == b"":
        return asked
    host = _text(value, "a node's endpoint")
    return None if host == "?" else host


def _node(host: str | None, port: int, loopback_only: bool) -> Address | None:
    if host is None:
        return None
    problem = address_problem(host, port, loopback_only=loopback_only)
    if problem is not None:
        raise SlotMapError(f"node {host}:{port}: {problem}")
    return (host, port)


def parse_shards(reply: object, asked: str, *, tls: bool, loopback_only: bool) -> SlotMap:
    """The map of a `CLUSTER SHARDS` reply from a node reached at host `asked`.

    A shard's primary is its node of role "master" (or "primary"); the port is its
    "tls-port" when the tier speaks TLS and the node lists one.
    """
    if not isinstance(reply, list):
        raise SlotMapError(f"CLUSTER SHARDS answered {type(reply).__name__}, not a list")
    ranges, replicas = [], []
    for i, raw in enumerate(reply):
        shard = _flat_map(raw, f"shard {i}")
        slots, nodes = shard.get("slots"), shard.get("nodes")
        if not isinstance(slots, list) or len(slots) % 2 or not isinstance(nodes, list):
            raise SlotMapError(f"shard {i} has no list of slot ranges and of nodes")
        primaries: list[Address] = []
        others: list[Address] = []
        for j, raw_node in enumerate(nodes):
            node = _flat_map(raw_node, f"node {j} of shard {i}")
            port_key = "tls-port" if tls and "tls-port" in node else "port"
            port = _int(node.get(port_key), f"the {port_key} of node {j} of shard {i}", 1, 65535)
            host = _endpoint(node.get("endpoint", node.get("ip")), asked)
            address = _node(host, port, loopback_only)
            if address is None:
                continue
            if node.get("role") in (b"master", b"primary"):
                # An online primary first: a failed one may still be listed beside it.
                primaries.insert(0 if node.get("health") == b"online" else len(primaries), address)
            else:
                others.append(address)
        primary = primaries[0] if primaries else None
        replicas += primaries[1:] + others
        if primary is None:
            continue  # a shard without a reachable primary: its slots are served by none
        for k in range(0, len(slots), 2):
            first = _int(slots[k], f"a slot of shard {i}", 0, SLOTS - 1)
            last = _int(slots[k + 1], f"a slot of shard {i}", first, SLOTS - 1)
            ranges.append((first, last, primary))
    return SlotMap.from_ranges(ranges, replicas)


def parse_slots(reply: object, asked: str, *, loopback_only: bool) -> SlotMap:
    """The map of a `CLUSTER SLOTS` reply: `[first, last, primary, replica...]` per
    range, each node `[endpoint, port, id, ...]`."""
    if not isinstance(reply, list):
        raise SlotMapError(f"CLUSTER SLOTS answered {type(reply).__name__}, not a list")
    ranges, replicas = [], []
    for i, entry in enumerate(reply):
        if not isinstance(entry, list) or len(entry) < 3:
            raise SlotMapError(f"slot range {i} is not [first, last, primary, ...]")
        first = _int(entry[0], f"the first slot of range {i}", 0, SLOTS - 1)
        last = _int(entry[1], f"the last slot of range {i}", first, SLOTS - 1)
        addresses = []
        for j, node in enumerate(entry[2:]):
            if not isinstance(node, list) or len(node) < 2:
                raise SlotMapError(f"node {j} of slot range {i} is not [endpoint, port, ...]")
            port = _int(node[1], f"the port of node {j} of slot range {i}", 1, 65535)
            addresses.append(_node(_endpoint(node[0], asked), port, loopback_only))
        if addresses[0] is not None:
            ranges.append((first, last, addresses[0]))
        replicas += [a for a in addresses[1:] if a is not None]
    return SlotMap.from_ranges(ranges, replicas)
