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
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = [
    "DemoConfigError",
    "DemoModelConfig",
    "Progress",
    "ScenarioConfig",
    "check_kernel_backend",
    "check_tiers",
    "tier_entry",
]

Progress = Callable[[str, int, int], None]
"""`progress(step_name, done, total)`: `done=0` as a step starts (long steps), then after
each unit of work (a model step of a prefill, a role's process)."""

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

    def __post_init__(self) -> None:
        _positive(self, ("vocab_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"))
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
    tiers: tuple[str, ...] = ()  # "disk:PATH" or "redis://HOST:PORT" (tier_entry)

    def __post_init__(self) -> None:
        for spec in self.tiers:
            tier_entry(spec)  # refuses a bad one now, naming it
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


def check_kernel_backend(name: object) -> None:
    """`name` is "auto" or a backend of the `pallas_kernels` registry that runs on this
    platform (jax's default device); anything else fails here, before the model is built,
    with what does run."""
    if name == "auto":
        return
    import jax

    import pallas_kernels as pk

    try:
        record = pk.get_backend(name)
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
    created if missing, 1 GiB budget) or a `redis://` / `rediss://` / `unix://` URL."""
    if not isinstance(spec, str):
        raise DemoConfigError(f"--tier {spec!r}: must be disk:PATH or redis://HOST:PORT")
    if spec.startswith("disk:") and len(spec) > 5:
        return {"type": "disk", "path": spec[5:], "capacity_bytes": "1GiB"}
    if spec.split("://", 1)[0] in ("redis", "rediss", "unix") and "://" in spec:
        return {"type": "redis", "url": spec}
    raise DemoConfigError(
        f"--tier {_shown(spec)!r}: must be disk:PATH (a directory) or redis://HOST:PORT "
        "(a running Redis or Valkey server)"
    )


def check_tiers(specs: tuple[str, ...] | list[str]) -> None:
    """Checks each `--tier` as far as can be done before the demo starts: its form, its
    options (the tier's own config), a disk tier's directory (made 0700 if missing,
    refused if others can reach it, as the tier will) and that a Redis server accepts a
    connection. Raises `DemoConfigError`, or the tier's `KVOffloadError`, naming it."""
    from jax_kvoffload.config import DiskTierConfig, RedisTierConfig
    from jax_kvoffload.tiers import DiskTier

    for spec in specs:
        entry = tier_entry(spec)
        if entry["type"] == "disk":
            DiskTier.check_path(
                DiskTierConfig(**{k: v for k, v in entry.items() if k != "type"}).path
            )
        else:
            _check_reachable(spec, RedisTierConfig(url=entry["url"]).endpoint)


def _check_reachable(spec: str, endpoint: dict) -> None:
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
            f"{CONNECT_TIMEOUT_S:g} s); start a Redis or Valkey server there, or drop this --tier"
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
