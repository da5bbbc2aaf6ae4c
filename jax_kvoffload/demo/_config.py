"""The demo's sizes and tiers, checked without importing jax.

Importing jax (and flax) takes 8-17 s on a busy 2-core machine; a typo in `--tier`, a
tier directory others can read or a Redis server that is not running is reported before
that (`jax-kvoffload demo` checks its arguments first, then imports the model). Only
`kernel_backend` other than "auto" needs jax: the registry knows what this platform
runs only once jax has found its devices, so that check comes last.
"""

from __future__ import annotations

import os
import socket
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DemoConfigError",
    "DemoModelConfig",
    "Progress",
    "ScenarioConfig",
    "check_kernel_backend",
    "check_mesh_sizes",
    "check_tiers",
    "parse_mesh_sizes",
    "tier_entry",
]

Progress = Callable[[str, int, int], None]
"""`progress(step_name, done, total)`: `done=0` as a step starts (long steps), then after
each unit of work (a model step of a prefill, a role's process)."""

#: The demo model's cache layouts (`DemoModelConfig.cache_layout`, `--layout`).
CACHE_LAYOUTS = ("nhd", "rpa")

#: The most devices one role's mesh may have: the demo's meshes live on one host (as many
#: forced host devices on CPU), and XLA starts a thread per device.
MAX_MESH_DEVICES = 64

#: How long `check_tiers` waits for a Redis server to accept a connection.
CONNECT_TIMEOUT_S = 2.0


class DemoConfigError(ValueError):
    """Bad demo model or scenario sizes (the message names the field)."""


def _positive(owner: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(owner, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise DemoConfigError(f"{name}={value!r} must be a positive int")


@dataclass(frozen=True, kw_only=True)
class DemoModelConfig:
    """Sizes of the demo model; `d_model = num_heads * head_dim`."""

    vocab_size: int = 1024
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    ffn_dim: int = 1024
    rope: bool = True
    rope_theta: float = 10000.0
    seed: int = 0
    #: "nhd": `[num_blocks, 2, block_size, kv_heads, head_dim]`; "rpa": tpu-inference's
    #: ragged-paged-attention v3 cache (docs/tpu_inference.md, "The demo").
    cache_layout: str = "nhd"

    def __post_init__(self) -> None:
        _positive(self, ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"))
        if self.cache_layout not in CACHE_LAYOUTS:
            raise DemoConfigError(
                f"cache_layout={self.cache_layout!r}: use one of {CACHE_LAYOUTS} (--layout)"
            )
        if self.ffn_dim < 1:
            raise DemoConfigError(f"ffn_dim={self.ffn_dim!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise DemoConfigError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads="
                f"{self.num_kv_heads} (grouped-query attention)"
            )
        if self.rope and self.head_dim % 2:
            raise DemoConfigError(f"head_dim={self.head_dim} must be even with RoPE")

    @property
    def d_model(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True, kw_only=True)
class ScenarioConfig:
    """Scenario sizes. `skip_load` is a negative control: B trusts the lookup but never
    loads, so its prefix blocks hold whatever they held before and the check must fail."""

    model: DemoModelConfig = field(default_factory=DemoModelConfig)
    block_size: int = 16
    prompt_blocks: int = 8
    suffix_tokens: int = 24
    decode_tokens: int = 4
    blocks_per_chunk: int = 2
    kernel_backend: str = "auto"
    skip_load: bool = False
    tiers: tuple[str, ...] = ()  # "disk:PATH", "redis://...", "mooncake://..." (tier_entry)
    # Two-process mode: the writer's and the reader's mesh sizes (canonical pages); None:
    # both on one device, direct pages.
    mesh_sizes: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for spec in self.tiers:
            tier_entry(spec)  # refuses a bad one now, naming it
        if self.mesh_sizes is not None:
            check_mesh_sizes(self.mesh_sizes, self.model.num_kv_heads)
            if self.model.cache_layout != "nhd":  # the sharded demo caches are NHD only
                raise DemoConfigError(
                    f"--mesh-sizes with --layout {self.model.cache_layout}: the demo shards "
                    f"only NHD caches over a mesh; drop --layout or --mesh-sizes"
                )
        _positive(self, ("block_size", "prompt_blocks", "suffix_tokens", "blocks_per_chunk"))
        if self.decode_tokens < 0:
            raise DemoConfigError(f"decode_tokens={self.decode_tokens} must be >= 0")
        if self.prompt_blocks < self.blocks_per_chunk:
            raise DemoConfigError(
                f"prompt_blocks={self.prompt_blocks} holds no whole chunk of "
                f"blocks_per_chunk={self.blocks_per_chunk} blocks: nothing could be offloaded; "
                f"use prompt_blocks >= {self.blocks_per_chunk}"
            )
        _check_footprint(self)
        check_kernel_backend(self.kernel_backend)  # last: imports jax unless "auto"

    @property
    def tail_tokens(self) -> int:
        """A's own tokens after the shared prefix (a partial block: never offloaded)."""
        return max(1, self.block_size // 2)

    @property
    def max_blocks_per_seq(self) -> int:
        longest = self.prompt_blocks * self.block_size + max(self.suffix_tokens, self.tail_tokens)
        return -(-(longest + self.decode_tokens) // self.block_size)

    @property
    def offloaded_chunks(self) -> int:
        """Whole chunks of A's prefix: what is stored (and cascaded into each tier)."""
        return self.prompt_blocks // self.blocks_per_chunk

    @property
    def offloaded_blocks(self) -> int:
        """A's prefix blocks in whole chunks: what B can hit."""
        return self.offloaded_chunks * self.blocks_per_chunk


def footprint(cfg: ScenarioConfig) -> tuple[int, int]:
    """(cache bytes, weight bytes) the demo allocates on the device, about: every layer's
    uint32 cache of 3 sequences' blocks plus a chunk, and float32 weights; the host tier
    holds a copy of the offloaded part."""
    m = cfg.model
    blocks = 3 * cfg.max_blocks_per_seq + cfg.blocks_per_chunk
    cache = m.num_layers * blocks * 2 * cfg.block_size * m.num_kv_heads * m.head_dim * 4
    kv = m.num_kv_heads * m.head_dim
    layer = m.d_model * (m.d_model * 2 + kv * 2) + 3 * m.d_model * m.ffn_dim
    return cache, 4 * (2 * m.vocab_size * m.d_model + m.num_layers * layer)


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX sysconf: no bound known
        return None


def _check_footprint(cfg: ScenarioConfig) -> None:
    # Sizes are unbounded ints: `--block-size 1000000000` would ask XLA for terabytes
    # after the 8-17 s of importing jax, and fail (or swap) there with no word of which
    # flag; say it now, in the flags' terms.
    cache, weights = footprint(cfg)
    memory = _memory_bytes()
    limit = memory // 2 if memory else 1 << 50
    if cache + weights > limit:
        raise DemoConfigError(
            f"the demo's sizes need about {_gib(cache)} of KV cache and {_gib(weights)} of "
            f"weights, more than half this machine's {_gib(memory or 0)} of memory; lower "
            "--block-size, --prompt-blocks, --suffix-tokens, --layers, --kv-heads, "
            "--head-dim, --vocab or --ffn-dim (the defaults take about 40 MiB)"
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def check_mesh_sizes(sizes: object, kv_heads: int) -> None:
    """`sizes` is (writer, reader), two positive device counts over which `kv_heads` KV
    heads shard into whole heads (one divides the other)."""
    if not (isinstance(sizes, tuple) and len(sizes) == 2) or any(
        not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= MAX_MESH_DEVICES
        for n in sizes
    ):
        raise DemoConfigError(
            f"--mesh-sizes {sizes!r}: must be two positive device counts (at most "
            f"{MAX_MESH_DEVICES}: one host's), the writer's and the reader's, e.g. 2,4"
        )
    for n in sizes:
        if n % kv_heads and kv_heads % n:
            raise DemoConfigError(
                f"--mesh-sizes: {n} devices cannot hold --kv-heads {kv_heads} as whole heads "
                "(one must divide the other); pick sizes such as 1, 2, 4 for 2 or 4 KV heads"
            )


def parse_mesh_sizes(text: str) -> tuple[int, int]:
    """`"2,4"` -> (2, 4); anything else raises `DemoConfigError`."""
    parts = text.split(",")
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if len(sizes) != 2:
        raise DemoConfigError(
            f"--mesh-sizes {text!r}: must be WRITER,READER device counts, e.g. 2,4"
        )
    return sizes  # type: ignore[return-value]


def check_kernel_backend(name: object) -> None:
    """`name` is "auto" or a backend of the `pallas_kernels` registry that runs on this
    platform (jax's default device); anything else fails here, before the model is built,
    with what does run."""
    if name == "auto":
        return
    import jax

    import pallas_kernels as pk

    try:
        record = pk.get_backend(name)  # type: ignore[arg-type]  # not a str: TypeError
    except (TypeError, pk.BackendUnavailableError) as exc:
        raise DemoConfigError(f"kernel_backend={name!r}: {exc}") from None
    runs = ("auto", *pk.supported_backends())
    if name not in runs:
        device = jax.devices()[0]
        raise DemoConfigError(
            f"kernel_backend={name!r} needs {record.where}, but this platform is "
            f"{device.platform} ({device.device_kind}); choose one of {runs}"
        )


def tier_entry(spec: str) -> dict:
    """A `secondary_tiers` entry from a `--tier` value: `disk:PATH` (a private directory,
    created if missing, 1 GiB budget), a `redis://` / `rediss://` / `unix://` URL: one
    server, or any node of a Redis / Valkey Cluster (the tier finds the others; several
    nodes of one cluster, comma-separated `redis://10.0.0.1:6379,10.0.0.2:6379`: the
    first is the URL, the others its `seed_urls`, asked when it does not answer), or a
    Mooncake Store's master `mooncake://HOST:PORT[?metadata=URL&local=HOST]` (metadata:
    the master's HTTP metadata server at HOST:8080, mooncake_master's default port, unless
    given; local: this process's address, 127.0.0.1 unless given)."""
    if not isinstance(spec, str):
        raise DemoConfigError(f"--tier {spec!r}: must be disk:PATH or redis://HOST:PORT")
    if spec.startswith("disk:") and len(spec) > 5:
        return {"type": "disk", "path": spec[5:], "capacity_bytes": "1GiB"}
    scheme = spec.split("://", 1)[0]
    if scheme in ("redis", "rediss", "unix") and "://" in spec:
        if scheme == "unix" or "," not in spec:
            return {"type": "redis", "url": spec}
        # Commas after the credentials (a password may hold one: RFC 3986 allows it).
        creds, at, nodes = spec.rpartition("@")
        first, *more = nodes.split(",")
        first = creds + at + first
        if not more:
            return {"type": "redis", "url": first}
        seeds = [m if "://" in m else f"{scheme}://{m}" for m in more]
        return {"type": "redis", "url": first, "seed_urls": seeds}
    if spec.startswith("mooncake://") and len(spec) > 11:
        return _mooncake_entry(spec)
    raise DemoConfigError(
        f"--tier {_shown(spec)!r}: must be disk:PATH (a directory), redis://HOST:PORT (a "
        "running Redis or Valkey server) or mooncake://HOST:PORT (a Mooncake Store's master)"
    )


_MOONCAKE_QUERY = ("metadata", "local")


def _mooncake_entry(spec: str) -> dict:
    """`mooncake://HOST:PORT[?metadata=URL&local=HOST]` as a tier entry; a user, path,
    fragment, or a query key other than `metadata` / `local` (a typo: it would be
    dropped, and the default used without a word) is refused."""
    parts = urllib.parse.urlsplit(spec)
    try:
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        query = {"": [parts.query]} if parts.query else {}
    odd = sorted(set(query) - set(_MOONCAKE_QUERY))
    twice = sorted(k for k, v in query.items() if len(v) > 1 or v == [""])
    if odd or twice or "@" in parts.netloc or parts.path or parts.fragment:
        got = f"query keys {odd}" if odd else f"{twice} repeated or empty" if twice else (
            "a user, path or fragment")  # fmt: skip
        raise DemoConfigError(
            f"--tier {_shown(spec)}: must be mooncake://HOST:PORT[?metadata=URL&local=HOST], "
            f"each query key once and with a value (got {got})"
        )
    host = parts.hostname or ""
    shown = f"[{host}]" if ":" in host else host  # an IPv6 master: bracketed in the URL
    return {
        "type": "mooncake",
        "master_server_address": parts.netloc,
        "metadata_server": query.get("metadata", [f"http://{shown}:8080/metadata"])[0],
        "local_hostname": query.get("local", ["127.0.0.1"])[0],
    }


def check_tiers(specs: tuple[str, ...] | list[str]) -> None:
    """Checks each `--tier` as far as can be done before the demo starts: its form, its
    options (the tier's own config), a disk tier's directory (made 0700 if missing,
    refused if others can reach it, as the tier will) and that a Redis server accepts a
    connection. Raises `DemoConfigError`, or the tier's `KVOffloadError`, naming it."""
    from jax_kvoffload.config import DiskTierConfig, MooncakeTierConfig, RedisTierConfig
    from jax_kvoffload.tiers import DiskTier

    for spec in specs:
        entry = tier_entry(spec)
        if entry["type"] == "disk":
            DiskTier.check_path(
                DiskTierConfig(**{k: v for k, v in entry.items() if k != "type"}).path
            )
        elif entry["type"] == "mooncake":
            cfg = MooncakeTierConfig(**{k: v for k, v in entry.items() if k != "type"})
            host, port = cfg.master_address
            _check_reachable(spec, {"scheme": "tcp", "host": host, "port": port}, "mooncake")
            meta = urllib.parse.urlsplit(cfg.metadata_server)
            if meta.scheme.lower() in ("http", "https"):  # the master's own, most often
                # Without it Mooncake's setup retries 20 times, then the demo fails late.
                where = {"scheme": "tcp", "host": meta.hostname, "port": meta.port}
                _check_reachable(spec, where, "mooncake metadata")
        else:
            config = RedisTierConfig(**{k: v for k, v in entry.items() if k != "type"})
            _check_any_reachable(spec, [config.url, *(config.seed_urls or ())])


def _check_any_reachable(spec: str, urls: list[str]) -> None:
    """One of a cluster's nodes (a server: its one URL) accepts a connection."""
    from jax_kvoffload.config import RedisTierConfig

    failures = []
    for url in urls:
        try:
            _check_reachable(spec, RedisTierConfig(url=url).endpoint)
            return
        except DemoConfigError as exc:
            failures.append(exc)
    raise failures[0]


def _check_reachable(spec: str, endpoint: Mapping[str, Any], kind: str = "redis") -> None:
    if endpoint["scheme"] == "unix":
        family, address, where = socket.AF_UNIX, endpoint["path"], endpoint["path"]
    else:
        family, address = None, (endpoint["host"], endpoint["port"])
        where = f"{endpoint['host']}:{endpoint['port']}"
    try:
        if family is None:
            socket.create_connection(address, timeout=CONNECT_TIMEOUT_S).close()
        else:
            with socket.socket(family) as s:
                s.settimeout(CONNECT_TIMEOUT_S)
                s.connect(address)
    except OSError as exc:
        why = "no answer" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise DemoConfigError(
            f"--tier {_shown(spec)}: cannot connect to {where} ({why} within "
            f"{CONNECT_TIMEOUT_S:g} s); start "
            + {
                "mooncake": "mooncake_master",
                "mooncake metadata": "mooncake_master --enable_http_metadata_server (or "
                "give ?metadata=URL of the running one)",
            }.get(kind, "a Redis or Valkey server")
            + " there, or drop this --tier"
        ) from None


def _shown(spec: str) -> str:
    """`spec` without a password written in its URL (errors end up in logs)."""
    try:
        parts = urllib.parse.urlsplit(spec)
        if parts.password is None:
            return spec
    except ValueError:  # not a URL urllib can split (a bad port, brackets)
        return spec.split("@")[-1] if "@" in spec else spec
    user = parts.username or ""
    return parts._replace(netloc=f"{user}:***@{parts.netloc.rpartition('@')[2]}").geturl()
