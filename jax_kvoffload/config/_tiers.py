"""Secondary-tier configuration: vLLM 0.33.0's `secondary_tiers` extra-config key, typed.

vLLM's `TieringOffloadingSpec` reads `kv_connector_extra_config["secondary_tiers"]`: a
list of dicts, each with a `type` (a registered tier, or a class name paired with
`module_path`), an optional `backpressure` dict (consumed by vLLM's factory), an
optional `locality` and tier-specific keyword arguments. The same list is parsed here,
once, into frozen dataclasses:

- `{"type": "disk", ...}` -> `DiskTierConfig`, `{"type": "redis", ...}` -> `RedisTierConfig`
  (ours; also reached as vLLM out-of-tree tiers `{"type": "JaxDiskTier" / "JaxRedisTier",
  "module_path": "jax_kvoffload.bridge._vllm_tiers", ...}` with the same options);
- vLLM's own tiers (`example`, `fs`, `p2p`, `obj`, `kvcr`) and other out-of-tree classes
  -> `VllmTierConfig`, kept verbatim: only vLLM can build them.

Every error is a `TierConfigError` naming the entry, the key, the value and the fix.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from jax_kvoffload.config._frozen import FrozenDict, thaw
from jax_kvoffload.config._tier_values import (
    ABSENT,
    MAX_THREADS,
    TierConfigError,
    check_bool,
    check_cluster,
    check_common,
    check_host,
    check_int,
    check_opt_str,
    check_path,
    check_seconds,
    check_size,
    parse_redis_url,
    redacted,
)

__all__ = [
    "OUR_TIER_CLASSES",
    "VLLM_TIER_TYPES",
    "DiskTierConfig",
    "RedisTierConfig",
    "TierConfig",
    "TierConfigError",
    "VllmTierConfig",
    "parse_secondary_tiers",
    "secondary_tiers_from_extra_config",
]

# vLLM 0.33.0's registered tier types (`vllm/v1/kv_offload/tiering/factory.py`).
VLLM_TIER_TYPES = ("example", "fs", "p2p", "obj", "kvcr")
# Our tiers under the class names vLLM's factory resolves with `module_path`.
OUR_TIER_CLASSES = {"JaxDiskTier": "disk", "JaxRedisTier": "redis"}
BRIDGE_MODULE = "jax_kvoffload.bridge._vllm_tiers"
_ABSENT = ABSENT
_DIRECT_IO = {True: "on", False: "off", "auto": "auto", "on": "on", "off": "off"}


def _set(obj: object, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # frozen: normalising in __post_init__


@dataclass(frozen=True, kw_only=True)
class _TierOptions:
    """Keys every tier entry may carry (vLLM's factory reads them too).

    Attributes:
      locality: "LOCAL" or "REMOTE" (vLLM's `Locality`; picks backpressure watermarks).
      backpressure: vLLM's per-tier backpressure dict, kept verbatim.
      enable_kv_events: emit KV events for entries stored in this tier (vLLM's `fs` key).
    """

    type: ClassVar[str] = ""
    locality: str | None = None
    backpressure: FrozenDict | None = None
    enable_kv_events: bool = False

    def __post_init__(self) -> None:
        where = type(self).__name__
        values = check_common(where, self.locality, self.backpressure, self.enable_kv_events)
        for name, value in zip(
            ("locality", "backpressure", "enable_kv_events"), values, strict=True
        ):
            _set(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        """Our shape, `{"type": "disk", ...}`; `parse_secondary_tiers` inverts it."""
        out: dict[str, Any] = {"type": self.type}
        for f in fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                out[f.name] = thaw(value)
        return out

    def to_vllm_dict(self) -> dict[str, Any]:
        """vLLM's out-of-tree shape, for `TieringOffloadingSpec`'s `secondary_tiers`."""
        out = self.to_dict()
        cls = next(c for c, t in OUR_TIER_CLASSES.items() if t == self.type)
        out.update(type=cls, module_path=BRIDGE_MODULE)
        return out


@dataclass(frozen=True, kw_only=True)
class DiskTierConfig(_TierOptions):
    """A crash-safe local-disk tier (docs/tiers.md).

    Attributes:
      path: directory of the tier; created 0700 if missing, refused if someone else owns
        it or it is group/other-accessible or a symbolic link.
      capacity_bytes: byte budget of the directory; least recently used entries go first.
      read_threads / write_threads: I/O threads; loads never queue behind stores.
      max_pending_store_bytes: store bytes queued before new stores are dropped.
      direct_io: "auto" (probe the filesystem), "on" (require O_DIRECT) or "off".
      fsync: make entries durable (file and directory fsync); entries are never wrong
        without it, but a power loss may lose recent ones.
      rescan_timeout_s: bound on the start-up scan that rebuilds the LRU index.
    """

    type: ClassVar[str] = "disk"
    path: str
    capacity_bytes: int
    # I/O threads mostly wait on the device (fsync latency, queue depth): more threads
    # than cores keep several writes in flight; vLLM's fs tier uses 16 of each.
    read_threads: int = 8
    write_threads: int = 8
    max_pending_store_bytes: int = 256 << 20
    direct_io: str = "auto"
    fsync: bool = True
    rescan_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        super().__post_init__()
        w = type(self).__name__
        _set(self, "path", check_path(w, "path", self.path))
        _set(self, "capacity_bytes", check_size(w, "capacity_bytes", self.capacity_bytes))
        for key in ("read_threads", "write_threads"):
            _set(self, key, check_int(w, key, getattr(self, key), minimum=1, maximum=MAX_THREADS))
        pending = check_size(w, "max_pending_store_bytes", self.max_pending_store_bytes)
        _set(self, "max_pending_store_bytes", pending)
        d = self.direct_io
        if isinstance(d, (bool, str)) and d in _DIRECT_IO:
            _set(self, "direct_io", _DIRECT_IO[d])
        else:
            raise TierConfigError(w, "direct_io", d, 'must be "auto", "on" or "off"')
        _set(self, "fsync", check_bool(w, "fsync", self.fsync))
        timeout = check_seconds(w, "rescan_timeout_s", self.rescan_timeout_s)
        _set(self, "rescan_timeout_s", timeout)


@dataclass(frozen=True, kw_only=True)
class RedisTierConfig(_TierOptions):
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

    type: ClassVar[str] = "redis"
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
        _set(self, "cluster", mode)
        _set(self, "seed_urls", seeds)
        for key in ("read_connections", "write_connections"):
            _set(self, key, check_int(w, key, getattr(self, key), minimum=1, maximum=MAX_THREADS))
        for key in ("connect_timeout_s", "io_timeout_s", "retry_after_s"):
            _set(self, key, check_seconds(w, key, getattr(self, key)))
        for key in ("max_pending_store_bytes", "batch_bytes"):
            _set(self, key, check_size(w, key, getattr(self, key)))
        if self.ttl_s is not None:
            # Redis keeps expiries in milliseconds of a signed 64-bit clock.
            _set(self, "ttl_s", check_int(w, "ttl_s", self.ttl_s, minimum=1, maximum=2**31 - 1))
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
    def endpoint(self) -> dict[str, Any]:
        """The parsed URL: scheme, host, port, path (unix), db, username, password."""
        return parse_redis_url(type(self).__name__, "url", self.url)

    @property
    def seed_addresses(self) -> tuple[tuple[str, int], ...]:
        """`(host, port)` of each of `seed_urls`."""
        w = type(self).__name__
        return tuple(
            (ep["host"], ep["port"])
            for ep in (parse_redis_url(w, "seed_urls", u) for u in self.seed_urls)
        )


@dataclass(frozen=True, kw_only=True)
class VllmTierConfig:
    """A tier only vLLM can build (its own types, or another out-of-tree class).

    Attributes:
      type: the vLLM tier type or class name.
      module_path: where vLLM imports `type` from (out-of-tree tiers).
      options: every other key of the entry, verbatim.
    """

    type: str
    module_path: str | None = None
    options: FrozenDict = field(default_factory=FrozenDict)

    def to_vllm_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.module_path is not None:
            out["module_path"] = self.module_path
        out.update(thaw(self.options))
        return out

    to_dict = to_vllm_dict


TierConfig = DiskTierConfig | RedisTierConfig | VllmTierConfig


def _unknown(where: str, raw: Mapping[str, Any], cls: type) -> None:
    known = sorted({f.name for f in fields(cls)} | {"type", "module_path"})
    for key in raw:
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known keys: {known}"
        raise TierConfigError(where, str(key), raw[key], f"unknown key; {hint}")


def _missing(where: str, raw: Mapping[str, Any], key: str, example: str) -> Any:
    if key not in raw:
        raise TierConfigError(where, key, _ABSENT, f"is required, e.g. {example}")
    return raw[key]


def _build(where: str, cls: type, raw: dict[str, Any], required: dict[str, str]) -> Any:
    """`cls(**raw)` after the structural checks; the constructor checks every value
    (`__post_init__`) and its errors are reported at `where`."""
    for key, example in required.items():
        _missing(where, raw, key, example)
    known = {f.name for f in fields(cls)}
    _unknown(where, {k: v for k, v in raw.items() if k not in known}, cls)
    try:
        return cls(**raw)
    except TierConfigError as e:
        raise e.relocated(where) from None


def _disk(where: str, raw: dict[str, Any]) -> DiskTierConfig:
    required = {"path": '"path": "/var/cache/jax-kvoffload"', "capacity_bytes": '"64GiB"'}
    return _build(where, DiskTierConfig, raw, required)


def _redis(where: str, raw: dict[str, Any]) -> RedisTierConfig:
    return _build(where, RedisTierConfig, raw, {"url": '"redis://127.0.0.1:6379/0"'})


_PARSERS = {"disk": _disk, "redis": _redis}


def tier_config_from_dict(entry: Any, where: str = "secondary_tiers[0]") -> TierConfig:
    """One `secondary_tiers` entry, typed (see the module docstring for the shapes)."""
    if not isinstance(entry, Mapping):
        raise TierConfigError(
            where, None, entry, 'must be a dict like {"type": "disk", "path": ..., ...}'
        )
    raw = dict(entry)
    tier_type = raw.pop("type", None)
    module_path = raw.pop("module_path", None)
    if not isinstance(tier_type, str) or not tier_type:
        raise TierConfigError(
            where,
            "type",
            tier_type if "type" in entry else _ABSENT,
            f"is required: one of {sorted(_PARSERS)} (ours), {list(VLLM_TIER_TYPES)} "
            "(vLLM's), or a class name with module_path",
        )
    if module_path is not None and not isinstance(module_path, str):
        raise TierConfigError(where, "module_path", module_path, "must be a module path string")
    ours = OUR_TIER_CLASSES.get(tier_type) if module_path else None
    if ours is not None and module_path.startswith("jax_kvoffload."):
        return _PARSERS[ours](where, raw)
    if tier_type in _PARSERS:
        if module_path is not None:
            raise TierConfigError(
                where,
                "module_path",
                module_path,
                f'is not used with type "{tier_type}"; remove it, or use type '
                f'"{next(c for c, t in OUR_TIER_CLASSES.items() if t == tier_type)}"',
            )
        return _PARSERS[tier_type](where, raw)
    if tier_type not in VLLM_TIER_TYPES and module_path is None:
        close = difflib.get_close_matches(tier_type, [*_PARSERS, *VLLM_TIER_TYPES], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TierConfigError(
            where,
            "type",
            tier_type,
            f"unknown tier type; {hint}ours: {sorted(_PARSERS)}, vLLM's: "
            f"{list(VLLM_TIER_TYPES)}; an out-of-tree class also needs module_path",
        )
    return VllmTierConfig(type=tier_type, module_path=module_path, options=FrozenDict(raw))


def parse_secondary_tiers(value: Any, where: str = "secondary_tiers") -> tuple[TierConfig, ...]:
    """The typed tiers of a `secondary_tiers` value (None or a list of dicts)."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise TierConfigError(
            where,
            None,
            value,
            "must be a list of tier configurations (vLLM's rule); "
            'wrap one tier in a list: [{"type": "disk", ...}]',
        )
    return tuple(tier_config_from_dict(e, f"{where}[{i}]") for i, e in enumerate(value))


def secondary_tiers_from_extra_config(extra_config: Mapping[str, Any]) -> tuple[TierConfig, ...]:
    """`parse_secondary_tiers(extra_config.get("secondary_tiers"))`."""
    return parse_secondary_tiers(extra_config.get("secondary_tiers"))
