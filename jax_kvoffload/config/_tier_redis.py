"""The Redis tier's configuration (`{"type": "redis", ...}`; the tier: `tiers/_redis.py`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, cast

from jax_kvoffload.config._tier_options import TierOptions, set_checked
from jax_kvoffload.config._tier_values import (
    MAX_THREADS,
    RedisUrl,
    TierConfigError,
    check_bool,
    check_cluster,
    check_host,
    check_int,
    check_opt_str,
    check_seconds,
    check_size,
    parse_redis_url,
    redacted,
)

__all__ = ["RedisTierConfig"]


@dataclass(frozen=True, kw_only=True)
class RedisTierConfig(TierOptions):
    """A shared tier on a Redis-protocol server (Redis, Valkey; docs/tiers.md).

    Attributes:
      url: `redis://[user[:password]@]host[:port][/db]`, `rediss://...` (TLS) or
        `unix:///path/to/socket[?db=N]`.
      password_env: name of an environment variable holding the password (keeps it out of
        configs and logs); overrides a password in the URL.
      key_prefix: first part of every key, e.g. a tenant name for ACL key patterns.
      read_connections / write_connections: connections (one thread each) for loads and
        for stores; loads never queue behind stores.
      connect_timeout_s / io_timeout_s: bounds on connecting and on one pipelined batch.
      retry_after_s: after a failure, misses and dropped stores for this long (doubling
        up to 30 s while the server stays unreachable) instead of waiting on it.
      ttl_s: expiry of stored entries in seconds (None: the server's eviction decides).
      max_pending_store_bytes: store bytes queued before new stores are dropped.
      batch_bytes: bytes one connection pipelines before it reads the replies.
      tls_ca_file / tls_cert_file / tls_key_file / tls_verify / tls_server_name: TLS
        options for `rediss://` URLs (CA bundle, client certificate, verification, SNI).
      cluster: "auto" (follow a Redis Cluster's redirects once a node answers one), "on"
        (a cluster: read its slot map before the first command) or "off" (one server;
        a redirect is an error).
      seed_urls: more nodes of the same cluster (`redis://host:port`, the url's scheme,
        no credentials: those of `url` serve every node), asked for the slot map when
        `url`'s node does not answer; giving any means `cluster="on"`.
    """

    EXAMPLES: ClassVar = {"url": '"redis://127.0.0.1:6379/0"'}

    url: str
    password_env: str | None = None
    key_prefix: str = "jkv"
    read_connections: int = 4
    write_connections: int = 2
    connect_timeout_s: float = 1.0
    io_timeout_s: float = 5.0
    retry_after_s: float = 1.0
    ttl_s: int | None = None
    max_pending_store_bytes: int = 256 << 20
    batch_bytes: int = 8 << 20
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    tls_server_name: str | None = None
    cluster: str = "auto"
    seed_urls: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        w = type(self).__name__
        parse_redis_url(w, "url", self.url)
        mode, seeds = check_cluster(w, self.url, self.cluster, self.seed_urls)
        set_checked(self, "cluster", mode)
        set_checked(self, "seed_urls", seeds)
        for key in ("read_connections", "write_connections"):
            value = check_int(w, key, getattr(self, key), minimum=1, maximum=MAX_THREADS)
            set_checked(self, key, value)
        for key in ("connect_timeout_s", "io_timeout_s", "retry_after_s"):
            set_checked(self, key, check_seconds(w, key, getattr(self, key)))
        for key in ("max_pending_store_bytes", "batch_bytes"):
            set_checked(self, key, check_size(w, key, getattr(self, key)))
        if self.ttl_s is not None:
            # Redis keeps expiries in milliseconds of a signed 64-bit clock.
            ttl = check_int(w, "ttl_s", self.ttl_s, minimum=1, maximum=2**31 - 1)
            set_checked(self, "ttl_s", ttl)
        p = self.key_prefix
        if not isinstance(p, str) or not p or any(c.isspace() for c in p) or "\0" in p:
            raise TierConfigError(w, "key_prefix", p, "must be a non-empty string without spaces")
        for key in ("password_env", "tls_ca_file", "tls_cert_file", "tls_key_file"):
            check_opt_str(w, key, getattr(self, key))
        check_opt_str(w, "tls_server_name", self.tls_server_name)
        if self.tls_server_name is not None:
            check_host(w, "tls_server_name", self.tls_server_name)
        check_bool(w, "tls_verify", self.tls_verify)
        tls_set = [
            f.name
            for f in fields(self)
            if f.name.startswith("tls_") and getattr(self, f.name) != f.default
        ]
        if tls_set and not self.url.lower().startswith("rediss://"):
            key = tls_set[0]
            raise TierConfigError(
                w, key, getattr(self, key), "applies to TLS only; use a rediss:// URL"
            )

    def __repr__(self) -> str:
        # A password written in the URL must not reach logs, tracebacks or `config explain`.
        shown = ", ".join(
            f"{f.name}={redacted(self.url) if f.name == 'url' else getattr(self, f.name)!r}"
            for f in fields(self)
        )
        return f"{type(self).__name__}({shown})"

    __str__ = __repr__

    @property
    def endpoint(self) -> RedisUrl:
        """The parsed URL: scheme, host, port, path (unix), db, username, password."""
        return parse_redis_url(type(self).__name__, "url", self.url)

    @property
    def seed_addresses(self) -> tuple[tuple[str, int], ...]:
        """`(host, port)` of each of `seed_urls`."""
        w = type(self).__name__
        return tuple(
            (cast(str, ep["host"]), ep["port"])  # seeds are TCP URLs (`check_cluster`)
            for ep in (parse_redis_url(w, "seed_urls", u) for u in self.seed_urls)
        )
