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
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from jax_kvoffload.config._errors import OffloadConfigError
from jax_kvoffload.config._frozen import FrozenDict, thaw

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

_UNITS = {"": 1, "B": 1, "K": 1000, "M": 10**6, "G": 10**9, "T": 10**12}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(I?)B?\s*$", re.IGNORECASE)


class TierConfigError(OffloadConfigError):
    """A `secondary_tiers` entry is malformed; `where`, `key` and `value` locate it."""

    def __init__(self, where: str, key: str | None, value: Any, message: str) -> None:
        at = f"{where}.{key}" if key else where
        shown = "" if value is _ABSENT else f"={value!r}"
        super().__init__(f"{at}{shown}: {message}")
        self.where = where
        self.key = key
        self.value = None if value is _ABSENT else value


_ABSENT = object()


def _size(where: str, key: str, value: Any, *, minimum: int = 1) -> int:
    """Bytes as an int, an int string, or `<n>[K|M|G|T][i]B` ("64GiB" = 64 * 2**30)."""
    if isinstance(value, bool):
        raise TierConfigError(where, key, value, "must be a number of bytes, not a bool")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        unit = m.group(2).upper()
        base = 1024 ** " KMGT".index(unit) if m.group(3) and unit else _UNITS[unit]
        n = int(m.group(1)) * base
    else:
        raise TierConfigError(
            where, key, value, 'must be a number of bytes: an int or a string like "64GiB"'
        )
    if n < minimum:
        raise TierConfigError(where, key, value, f"must be at least {minimum} bytes")
    return n


def _int(where: str, key: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TierConfigError(where, key, value, f"must be an int >= {minimum}")
    if value < minimum:
        raise TierConfigError(where, key, value, f"must be >= {minimum}; use {minimum}")
    return value


def _seconds(where: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise TierConfigError(where, key, value, "must be a number of seconds > 0")
    return float(value)


def _bool(where: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TierConfigError(where, key, value, "must be true or false")
    return value


def _opt_str(where: str, key: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise TierConfigError(where, key, value, "must be a non-empty string (or absent)")
    return value


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

    @property
    def endpoint(self) -> dict[str, Any]:
        """The parsed URL: scheme, host, port, path (unix), db, username, password."""
        return _parse_redis_url("", "url", self.url)


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


def _parse_redis_url(where: str, key: str, url: Any) -> dict[str, Any]:
    if not isinstance(url, str) or not url:
        raise TierConfigError(where, key, url, 'must be a URL like "redis://127.0.0.1:6379/0"')
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    query = urllib.parse.parse_qs(parts.query)
    if scheme not in ("redis", "rediss", "unix"):
        raise TierConfigError(
            where, key, _redacted(url), "scheme must be redis://, rediss:// (TLS) or unix://"
        )
    db_text = query.get("db", [""])[0] if scheme == "unix" else parts.path.lstrip("/")
    if db_text and not db_text.isdigit():
        raise TierConfigError(where, key, _redacted(url), f"database {db_text!r} must be an int")
    try:
        port = parts.port
    except ValueError:
        raise TierConfigError(
            where, key, _redacted(url), "port must be an int in 1..65535"
        ) from None
    if scheme == "unix":
        if not parts.path:
            raise TierConfigError(where, key, url, "needs a socket path: unix:///path/redis.sock")
    elif not parts.hostname:
        raise TierConfigError(where, key, _redacted(url), "needs a host: redis://HOST:PORT")
    return {
        "scheme": scheme,
        "host": parts.hostname,
        "port": port or 6379,
        "path": parts.path if scheme == "unix" else None,
        "db": int(db_text or 0),
        "username": urllib.parse.unquote(parts.username) if parts.username else None,
        "password": urllib.parse.unquote(parts.password) if parts.password else None,
    }


def _redacted(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(":" + parts.password + "@", ":***@")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _common(where: str, raw: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "locality" in raw:
        loc = raw.pop("locality")
        if loc is not None:
            if not isinstance(loc, str) or loc.upper() not in ("LOCAL", "REMOTE"):
                raise TierConfigError(where, "locality", loc, 'must be "LOCAL" or "REMOTE"')
            loc = loc.upper()
        out["locality"] = loc
    if "backpressure" in raw:
        bp = raw.pop("backpressure")
        if bp is not None and not isinstance(bp, Mapping):
            raise TierConfigError(where, "backpressure", bp, "must be a dict (vLLM's shape)")
        out["backpressure"] = None if bp is None else FrozenDict(bp)
    if "enable_kv_events" in raw:
        out["enable_kv_events"] = _bool(where, "enable_kv_events", raw.pop("enable_kv_events"))
    return out


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


def _disk(where: str, raw: dict[str, Any]) -> DiskTierConfig:
    common = _common(where, raw)
    path = _missing(where, raw, "path", '"path": "/var/cache/jax-kvoffload"')
    if not isinstance(path, str) or not path:
        raise TierConfigError(where, "path", path, "must be a directory path string")
    cap = _size(where, "capacity_bytes", _missing(where, raw, "capacity_bytes", '"64GiB"'))
    kw: dict[str, Any] = {"path": path, "capacity_bytes": cap}
    for key in ("read_threads", "write_threads"):
        if key in raw:
            kw[key] = _int(where, key, raw[key], minimum=1)
    if "max_pending_store_bytes" in raw:
        kw["max_pending_store_bytes"] = _size(
            where, "max_pending_store_bytes", raw["max_pending_store_bytes"]
        )
    if "direct_io" in raw:
        d = raw["direct_io"]
        d = {True: "on", False: "off"}.get(d, d) if isinstance(d, bool) else d
        if d not in ("auto", "on", "off"):
            raise TierConfigError(where, "direct_io", raw["direct_io"], '"auto", "on" or "off"')
        kw["direct_io"] = d
    if "fsync" in raw:
        kw["fsync"] = _bool(where, "fsync", raw["fsync"])
    if "rescan_timeout_s" in raw:
        kw["rescan_timeout_s"] = _seconds(where, "rescan_timeout_s", raw["rescan_timeout_s"])
    _unknown(where, {k: v for k, v in raw.items() if k not in kw}, DiskTierConfig)
    return DiskTierConfig(**kw, **common)


def _redis(where: str, raw: dict[str, Any]) -> RedisTierConfig:
    common = _common(where, raw)
    url = _missing(where, raw, "url", '"redis://127.0.0.1:6379/0"')
    _parse_redis_url(where, "url", url)
    kw: dict[str, Any] = {"url": url}
    for key in ("read_connections", "write_connections"):
        if key in raw:
            kw[key] = _int(where, key, raw[key], minimum=1)
    for key in ("connect_timeout_s", "io_timeout_s", "retry_after_s"):
        if key in raw:
            kw[key] = _seconds(where, key, raw[key])
    for key in ("max_pending_store_bytes", "batch_bytes"):
        if key in raw:
            kw[key] = _size(where, key, raw[key])
    if raw.get("ttl_s") is not None:
        kw["ttl_s"] = _int(where, "ttl_s", raw["ttl_s"], minimum=1)
    elif "ttl_s" in raw:
        kw["ttl_s"] = None
    if "key_prefix" in raw:
        p = raw["key_prefix"]
        if not isinstance(p, str) or not p or any(c.isspace() for c in p):
            raise TierConfigError(
                where, "key_prefix", p, "must be a non-empty string without spaces"
            )
        kw["key_prefix"] = p
    if "password_env" in raw:
        kw["password_env"] = _opt_str(where, "password_env", raw["password_env"])
    for key in ("tls_ca_file", "tls_cert_file", "tls_key_file", "tls_server_name"):
        if key in raw:
            kw[key] = _opt_str(where, key, raw[key])
    if "tls_verify" in raw:
        kw["tls_verify"] = _bool(where, "tls_verify", raw["tls_verify"])
    _unknown(where, {k: v for k, v in raw.items() if k not in kw}, RedisTierConfig)
    tls_keys = [k for k in kw if k.startswith("tls_")]
    if tls_keys and not url.lower().startswith("rediss://"):
        raise TierConfigError(
            where, tls_keys[0], kw[tls_keys[0]], "applies to TLS only; use a rediss:// URL"
        )
    return RedisTierConfig(**kw, **common)


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
