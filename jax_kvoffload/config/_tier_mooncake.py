"""The Mooncake Store tier's configuration (`{"type": "mooncake", ...}`; the tier:
`tiers/_mooncake.py`). The keys carry Mooncake's own names (`mooncake_client`'s flags,
`MooncakeDistributedStore.setup`'s arguments), so a deployment's values carry over."""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from dataclasses import dataclass
from typing import ClassVar

from jax_kvoffload.config._tier_options import TierOptions, set_checked
from jax_kvoffload.config._tier_values import (
    MAX_THREADS,
    TierConfigError,
    check_host,
    check_int,
    check_opt_str,
    check_seconds,
    check_size,
)

__all__ = ["MooncakeTierConfig", "parse_host_port"]

PROTOCOLS = ("tcp", "rdma")
# What Mooncake's metadata client takes (transfer_metadata_plugin.cpp): an HTTP
# metadata server (the master's own with --enable_http_metadata_server), etcd, Redis,
# or the peer-to-peer handshake, which needs no server.
_METADATA_SCHEMES = ("http", "https", "etcd", "redis")
P2P_HANDSHAKE = "P2PHANDSHAKE"
# One object of Mooncake's holds at most this many replicas (ReplicateConfig).
MAX_REPLICAS = 8
# Every key the master holds carries the prefix (a tenant's, a fleet's name).
MAX_KEY_PREFIX = 128
_DEVICE = re.compile(r"^[A-Za-z0-9_.:-]+(,[A-Za-z0-9_.:-]+)*$")
# A host name or address as Mooncake takes it: the IDNA check alone lets "a b", "u@h"
# or "-x" through, which Mooncake's client then registers or dials verbatim.
_HOST = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def _check_mooncake_host(where: str, key: str, host: str, shown: object) -> None:
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if not _HOST.match(host):
        raise TierConfigError(
            where, key, shown, f"host {host!r:.80} must be an IP address or a host name "
            "(letters, digits, '.', '-', '_'), e.g. \"10.0.0.7\""
        )  # fmt: skip
    check_host(where, key, host, shown=shown)


def parse_host_port(where: str, key: str, value: object) -> tuple[str, int]:
    """`"host:port"` (or `"[v6]:port"`) as `(host, port)`; the port is required."""
    fix = 'must be "host:port", e.g. "10.0.0.5:50051"'
    if not isinstance(value, str) or not value or len(value) > 300:
        raise TierConfigError(where, key, value, fix)
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise TierConfigError(where, key, value, f"{host!r} is no IPv6 address") from None
    if not sep or not host or not (port.isascii() and port.isdigit() and len(port) <= 5):
        raise TierConfigError(where, key, value, fix)
    if not 0 < int(port) < 65536:
        raise TierConfigError(where, key, value, "port must be an int in 1..65535")
    _check_mooncake_host(where, key, host, value)
    return host, int(port)


def check_metadata_server(where: str, value: object) -> str:
    """An `http://host:port/path` (etcd://, redis://) URL or `"P2PHANDSHAKE"`."""
    fix = (
        'must be the metadata server, e.g. "http://10.0.0.5:8080/metadata" (the master '
        'with --enable_http_metadata_server), "etcd://10.0.0.5:2379" or "P2PHANDSHAKE"'
    )
    # No whitespace or control character: urlsplit drops tabs and newlines before it
    # parses, but Mooncake's client would send them in its HTTP request line.
    if not isinstance(value, str) or not value or len(value) > 1000 or not value.isprintable():
        raise TierConfigError(where, "metadata_server", value, fix)
    if any(c.isspace() for c in value):
        raise TierConfigError(where, "metadata_server", value, fix)
    if value == P2P_HANDSHAKE:
        return value
    try:
        parts = urllib.parse.urlsplit(value)
        port = parts.port
    except ValueError:
        raise TierConfigError(where, "metadata_server", value, fix) from None
    if parts.scheme.lower() not in _METADATA_SCHEMES or not parts.hostname or port is None:
        raise TierConfigError(where, "metadata_server", value, fix)
    check_host(where, "metadata_server", parts.hostname, shown=value)
    return value


@dataclass(frozen=True, kw_only=True)
class MooncakeTierConfig(TierOptions):
    """A shared tier on a Mooncake Store (docs/tiers.md, "Mooncake Store").

    Attributes:
      master_server_address: the `mooncake_master` RPC address, `"host:port"`.
      metadata_server: where the transfer engines find each other: the master's HTTP
        metadata server (`"http://host:port/metadata"`), etcd, or `"P2PHANDSHAKE"`.
      local_hostname: this engine's address as the other nodes reach it (its segment,
        if it mounts one, is read and written there).
      protocol: `"tcp"` or `"rdma"` (the transfer engine's transport).
      device_name: the RDMA device(s), `"mlx5_0"` or `"mlx5_0,mlx5_1"` (rdma only).
      global_segment_size: bytes of this process's memory mounted into the store for
        everyone's objects (0: none; storage nodes, `mooncake_client`, provide it).
      local_buffer_size: Mooncake's own staging buffer (0: none; this tier moves rows
        from and into registered memory, it does not use it).
      replica_num: copies of each entry on distinct segments (a node lost loses no
        entry while one copy remains).
      key_prefix: first part of every key (a tenant's name, a fleet's).
      read_threads / write_threads: threads issuing Mooncake batch calls for loads and
        for stores; loads never queue behind stores.
      batch_bytes: payload bytes of one batch call (one job spreads over the threads).
      max_pending_store_bytes: store bytes queued before new stores are dropped.
      connect_timeout_s: how long opening the tier waits for the master to answer.
      retry_after_s: after the master does not answer, misses and dropped stores for
        this long (doubling up to 30 s while it stays down) instead of waiting on it.
      max_entry_bytes: the largest entry a load reads whole to tell a wrong-length
        buffer from a damaged entry (larger ones are misses).
    """

    EXAMPLES: ClassVar = {
        "master_server_address": '"10.0.0.5:50051"',
        "metadata_server": '"http://10.0.0.5:8080/metadata"',
        "local_hostname": '"10.0.0.7"',
    }

    master_server_address: str
    metadata_server: str
    local_hostname: str
    protocol: str = "tcp"
    device_name: str | None = None
    global_segment_size: int = 0
    local_buffer_size: int = 0
    replica_num: int = 1
    key_prefix: str = "jkv"
    read_threads: int = 4
    write_threads: int = 2
    batch_bytes: int = 16 << 20
    max_pending_store_bytes: int = 256 << 20
    connect_timeout_s: float = 2.0
    retry_after_s: float = 1.0
    max_entry_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        super().__post_init__()
        w = type(self).__name__
        parse_host_port(w, "master_server_address", self.master_server_address)
        check_metadata_server(w, self.metadata_server)
        h = self.local_hostname
        if not isinstance(h, str) or not h or len(h) > 253:
            raise TierConfigError(w, "local_hostname", h, 'must be a host, e.g. "10.0.0.7"')
        _check_mooncake_host(w, "local_hostname", h, h)
        p = self.protocol
        if not isinstance(p, str) or p.lower() not in PROTOCOLS:
            raise TierConfigError(w, "protocol", p, 'must be "tcp" or "rdma"')
        set_checked(self, "protocol", p.lower())
        d = check_opt_str(w, "device_name", self.device_name)
        if d is not None and not _DEVICE.match(d):
            raise TierConfigError(
                w, "device_name", d, 'must be RDMA device names, e.g. "mlx5_0,mlx5_1"'
            )
        if self.protocol == "rdma" and d is None:
            raise TierConfigError(
                w, "device_name", None, 'protocol "rdma" needs the device, e.g. "mlx5_0"'
            )
        if self.protocol == "tcp" and d is not None:
            raise TierConfigError(
                w, "device_name", d, 'names an RDMA device, but protocol is "tcp"; drop one'
            )
        for key in ("global_segment_size", "local_buffer_size"):
            set_checked(self, key, check_size(w, key, getattr(self, key), minimum=0))
        for key, low, high in (
            ("replica_num", 1, MAX_REPLICAS),
            ("read_threads", 1, MAX_THREADS),
            ("write_threads", 1, MAX_THREADS),
        ):
            set_checked(self, key, check_int(w, key, getattr(self, key), minimum=low, maximum=high))
        for key in ("batch_bytes", "max_pending_store_bytes", "max_entry_bytes"):
            set_checked(self, key, check_size(w, key, getattr(self, key)))
        for key in ("connect_timeout_s", "retry_after_s"):
            set_checked(self, key, check_seconds(w, key, getattr(self, key)))
        k = self.key_prefix
        if (
            not isinstance(k, str) or not 0 < len(k) <= MAX_KEY_PREFIX
            or not k.isascii() or not k.isprintable() or " " in k
        ):  # fmt: skip
            raise TierConfigError(
                w, "key_prefix", k if not isinstance(k, str) else f"{k:.80}",
                f"must be printable ASCII without spaces, 1..{MAX_KEY_PREFIX} characters",
            )  # fmt: skip

    @property
    def master_address(self) -> tuple[str, int]:
        """`master_server_address` as `(host, port)`."""
        return parse_host_port(type(self).__name__, "master_server_address",
                               self.master_server_address)  # fmt: skip
