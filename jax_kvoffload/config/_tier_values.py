"""Checks of single `secondary_tiers` values, shared by the parser and by the typed tier
configurations themselves (`DiskTierConfig(...)` built directly is checked alike).

Every mistake is a `TierConfigError` naming where, the key, the value and the fix.
"""

from __future__ import annotations

import ipaddress
import numbers
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any, TypedDict

from jax_kvoffload.config._errors import OffloadConfigError
from jax_kvoffload.config._frozen import FrozenDict

__all__ = [
    "ABSENT",
    "MAX_SECONDS",
    "MAX_THREADS",
    "RedisUrl",
    "TierConfigError",
    "check_bool",
    "check_cluster",
    "check_common",
    "check_host",
    "check_int",
    "check_opt_str",
    "check_path",
    "check_seconds",
    "check_size",
    "parse_redis_url",
    "redacted",
]

ABSENT = object()
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 10**6, "G": 10**9, "T": 10**12}
# At most 30 digits: Python refuses to parse integers of more than 4300 digits with a
# ValueError of its own, and no byte count needs more than 30.
_SIZE = re.compile(r"^\s*(\d{1,30})\s*([KMGT]?)(I?)B?\s*$", re.IGNORECASE | re.ASCII)
# Timeouts become socket and condition-variable timeouts: past ~1e11 s those raise
# OverflowError (C time_t), and a wait of more than a week is no bound at all.
MAX_SECONDS = 7 * 86400.0
# One OS thread (and, for Redis, one connection) each; more than this is a typo.
MAX_THREADS = 256


class TierConfigError(OffloadConfigError):
    """A `secondary_tiers` entry is malformed; `where`, `key` and `value` locate it and
    `reason` says what is wrong and how to fix it."""

    def __init__(self, where: str, key: str | None, value: object, message: str) -> None:
        at = f"{where}.{key}" if key else where
        shown = "" if value is ABSENT else f"={value!r:.200}"
        super().__init__(f"{at}{shown}: {message}")
        self.where = where
        self.key = key
        self.value = None if value is ABSENT else value
        self.reason = message
        self._raw_value = value

    def relocated(self, where: str) -> TierConfigError:
        """The same error, reported at `where` (the parser's entry name)."""
        return TierConfigError(where, self.key, self._raw_value, self.reason)


MAX_SIZE = 2**63 - 1


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# The checks below take `value: Any` (a raw JSON or Python value): they accept any
# `numbers.Integral` / `numbers.Real` (numpy scalars too), and typeshed's numbers ABCs
# support no comparison with an int, so narrowing to them would not type-check either.


def check_size(where: str, key: str, value: Any, *, minimum: int = 1) -> int:
    """Bytes as an int, an int string, or `<n>[K|M|G|T][i]B` ("64GiB" = 64 * 2**30)."""
    if isinstance(value, bool):
        raise TierConfigError(where, key, value, "must be a number of bytes, not a bool")
    if _is_int(value):
        n = int(value)
    elif isinstance(value, str) and len(value) <= 64 and (m := _SIZE.match(value)):
        unit = m.group(2).upper()
        base = 1024 ** " KMGT".index(unit) if m.group(3) and unit else _UNITS[unit]
        n = int(m.group(1)) * base
    else:
        raise TierConfigError(
            where, key, value, 'must be a number of bytes: an int or a string like "64GiB"'
        )
    if n < minimum:
        raise TierConfigError(where, key, value, f"must be at least {minimum} bytes")
    if n > MAX_SIZE:  # offsets, lengths and the index are int64, as are the OS's
        raise TierConfigError(
            where, key, value, f"is past int64 ({MAX_SIZE}); use a size the machine has"
        )
    return n


def check_int(where: str, key: str, value: Any, *, minimum: int, maximum: int) -> int:
    if not _is_int(value):
        raise TierConfigError(
            where, key, value, f"must be an int in [{minimum}, {maximum}]; use e.g. {minimum}"
        )
    if not minimum <= value <= maximum:
        fix = minimum if value < minimum else maximum
        raise TierConfigError(where, key, value, f"must be in [{minimum}, {maximum}]; use {fix}")
    return int(value)


def check_seconds(where: str, key: str, value: Any) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not (0 < value <= MAX_SECONDS):  # NaN fails both comparisons
        raise TierConfigError(
            where,
            key,
            value,
            f"must be a finite number of seconds > 0 and at most {MAX_SECONDS:.0f}",
        )
    return float(value)


def check_bool(where: str, key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TierConfigError(where, key, value, "must be true or false")
    return value


def check_opt_str(where: str, key: str, value: object) -> str | None:
    if value is not None and (not isinstance(value, str) or not value or "\0" in value):
        raise TierConfigError(where, key, value, "must be a non-empty string (or absent)")
    return value


def check_path(where: str, key: str, value: object) -> str:
    if not isinstance(value, str) or not value or "\0" in value:
        raise TierConfigError(
            where, key, value, 'must be a directory path string (no NUL), e.g. "/var/cache/jkv"'
        )
    return value


def check_common(
    where: str, locality: object, backpressure: object, events: object
) -> tuple[str | None, FrozenDict | None, bool]:
    """`(locality, backpressure, enable_kv_events)`, checked and normalised."""
    if locality is not None:
        if not isinstance(locality, str) or locality.upper() not in ("LOCAL", "REMOTE"):
            raise TierConfigError(where, "locality", locality, 'must be "LOCAL" or "REMOTE"')
        locality = locality.upper()
    if backpressure is not None:
        if not isinstance(backpressure, Mapping):
            raise TierConfigError(
                where, "backpressure", backpressure, "must be a dict (vLLM's shape)"
            )
        if not isinstance(backpressure, FrozenDict):
            backpressure = FrozenDict(backpressure)
    return locality, backpressure, check_bool(where, "enable_kv_events", events)


class RedisUrl(TypedDict):
    """The parts of a Redis URL (`parse_redis_url`)."""

    scheme: str  # "redis", "rediss" or "unix"
    host: str | None  # None for unix://
    port: int
    path: str | None  # the socket's path, unix:// only
    db: int
    username: str | None
    password: str | None


def parse_redis_url(where: str, key: str, url: object) -> RedisUrl:
    """The parts of a `redis://`, `rediss://` or `unix://` URL (see `RedisTierConfig`)."""
    if not isinstance(url, str) or not url or "\0" in url:
        raise TierConfigError(where, key, url, 'must be a URL like "redis://127.0.0.1:6379/0"')
    try:
        parts = urllib.parse.urlsplit(url)
        hostname = parts.hostname
    except ValueError as e:  # e.g. "Invalid IPv6 URL"
        raise TierConfigError(
            where, key, redacted(url), f"is not a valid URL ({e}); e.g. redis://HOST:6379/0"
        ) from None
    try:
        port = parts.port
    except ValueError:
        port = 0
    scheme = parts.scheme.lower()
    query = urllib.parse.parse_qs(parts.query)
    if scheme not in ("redis", "rediss", "unix"):
        raise TierConfigError(
            where, key, redacted(url), "scheme must be redis://, rediss:// (TLS) or unix://"
        )
    db_text = query.get("db", [""])[0] if scheme == "unix" else parts.path.lstrip("/")
    if db_text and not (db_text.isascii() and db_text.isdigit() and len(db_text) <= 9):
        raise TierConfigError(where, key, redacted(url), f"database {db_text!r} must be an int")
    if port == 0:
        raise TierConfigError(where, key, redacted(url), "port must be an int in 1..65535")
    if scheme == "unix":
        if not parts.path:
            raise TierConfigError(where, key, url, "needs a socket path: unix:///path/redis.sock")
    elif not hostname:
        raise TierConfigError(where, key, redacted(url), "needs a host: redis://HOST:PORT")
    else:
        check_host(where, key, hostname, shown=redacted(url))
    return {
        "scheme": scheme,
        "host": hostname,
        "port": port or 6379,
        "path": parts.path if scheme == "unix" else None,
        "db": int(db_text or 0),
        "username": urllib.parse.unquote(parts.username) if parts.username else None,
        "password": urllib.parse.unquote(parts.password) if parts.password else None,
    }


_CLUSTER = {True: "on", False: "off", "auto": "auto", "on": "on", "off": "off"}
MAX_SEEDS = 64


def check_cluster(
    where: str, url: str, cluster: object, seeds: object
) -> tuple[str, tuple[str, ...]]:
    """`(cluster, seed_urls)` of a Redis tier, checked and normalised (`RedisTierConfig`):
    a cluster's nodes are TCP addresses with database 0 only, and every seed shares
    `url`'s scheme and credentials."""
    if not (isinstance(cluster, (bool, str)) and cluster in _CLUSTER):
        raise TierConfigError(where, "cluster", cluster, 'must be "auto", "on" or "off"')
    mode = _CLUSTER[cluster]
    if isinstance(seeds, (str, bytes)) or not isinstance(seeds, (list, tuple)):
        raise TierConfigError(
            where, "seed_urls", seeds, 'must be a list of URLs like ["redis://10.0.0.2:6379"]'
        )
    if len(seeds) > MAX_SEEDS:
        raise TierConfigError(
            where, "seed_urls", f"{len(seeds)} URLs", f"at most {MAX_SEEDS}; a few nodes suffice"
        )
    scheme = parse_redis_url(where, "url", url)["scheme"]
    for seed in seeds:
        ep = parse_redis_url(where, "seed_urls", seed)
        if ep["scheme"] != scheme or ep["path"] is not None:
            raise TierConfigError(
                where, "seed_urls", redacted(seed), f"must be a {scheme}:// URL, as url is"
            )
        if ep["username"] or ep["password"] or ep["db"]:
            raise TierConfigError(
                where,
                "seed_urls",
                redacted(seed),
                "must be redis[s]://host:port alone: url's credentials (or password_env) "
                "serve every node, and a cluster has database 0 only",
            )
    if seeds:
        if mode == "off":
            raise TierConfigError(
                where, "cluster", cluster, 'is "off", but seed_urls name cluster nodes'
            )
        mode = "on"
    if mode == "on":
        ep = parse_redis_url(where, "url", url)
        if ep["path"] is not None:
            raise TierConfigError(
                where, "url", url, "a cluster's nodes are TCP addresses: give redis://HOST:PORT"
            )
        if ep["db"]:
            raise TierConfigError(
                where, "url", redacted(url), "a cluster has database 0 only; drop the /N"
            )
    return mode, tuple(seeds)


def check_host(where: str, key: str, host: str, *, shown: object = ABSENT) -> None:
    """Refuses a host name no resolver takes: the C resolver (through Python's IDNA
    codec) raises `UnicodeError` for it at every connect, not a connection error."""
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    try:
        ok = 0 < len(host.rstrip(".").encode("idna")) <= 253
    except UnicodeError:
        ok = False
    if not ok:
        raise TierConfigError(
            where,
            key,
            host if shown is ABSENT else shown,
            f"host name {host!r:.80} is no name a resolver takes (dot-separated labels of "
            "1-63 characters, 253 in all); fix the host",
        )


def redacted(url: str) -> str:
    """`url` with its password replaced by `***`."""
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:
        return "<an unparsable URL>"
    if password is None:
        return url
    netloc = parts.netloc.replace(":" + password + "@", ":***@")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))
