"""The self-describing entry both tiers store: a header, then the payload bytes.

Header (little-endian; the same bytes in a disk file and in a Redis value):

| offset | size | field |
| --- | --- | --- |
| 0 | 8 | magic `b"JKVTIER\\x00"` |
| 8 | 2 | format version (`ENTRY_VERSION`) |
| 10 | 2 | header length in bytes (where the payload starts; >= 68 + key length) |
| 12 | 4 | flags (0; any other value is a format this reader does not know: a miss) |
| 16 | 32 | namespace digest (`namespace_digest`: model, dtype, layout, geometry, codec) |
| 48 | 8 | payload length in bytes |
| 56 | 4 | CRC32C of the payload |
| 60 | 2 | key length |
| 62 | 2 | reserved (0) |
| 64 | k | key (the offload key: block hash + 4-byte group index) |
| 64+k | 4 | CRC32C of bytes [0, 64+k) (the header protects itself) |
| 68+k | pad | zeros up to the header length (disk files align the payload for direct I/O) |

A reader accepts an entry only if every field checks out against what it asked for
(namespace, key, expected payload length) and both CRCs match; anything else is a miss
with a reason (`check_header` returns it). The namespace digest is SHA-256 over a
canonical JSON of the fields that fix the meaning of the bytes, so two engines share an
entry exactly when they would read its bytes the same way.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jax_kvoffload.config import OffloadingConfig
from jax_kvoffload.config.canonical import CANONICAL_FORMAT_VERSION, canonical_format_id
from jax_kvoffload.errors import KVOffloadTypeError, KVOffloadValueError
from jax_kvoffload.tiers._crc import crc32c

if TYPE_CHECKING:
    from jax_kvoffload.tiers._base import Buffer

__all__ = [
    "CODECS",
    "ENTRY_MAGIC",
    "ENTRY_VERSION",
    "FIXED_HEADER_BYTES",
    "MAX_KEY_BYTES",
    "EntryHeader",
    "check_header",
    "encode_header",
    "header_length",
    "namespace_digest",
    "namespace_fields",
]

ENTRY_MAGIC = b"JKVTIER\x00"
ENTRY_VERSION = 1
_FIXED = struct.Struct("<8sHHI32sQIHH")
FIXED_HEADER_BYTES = _FIXED.size  # 64
_CRC = struct.Struct("<I")
# Offload keys are a block hash (32 bytes for vLLM's sha256 hashes) plus 4 bytes; the
# bound keeps a whole header inside the first 4 KiB block that a direct read fetches.
MAX_KEY_BYTES = 1024
# Payload encodings. Only raw bytes today; the codec is part of the namespace, so a
# compressed entry can never be read as raw bytes.
CODECS = ("raw",)


@dataclass(frozen=True)
class EntryHeader:
    """A decoded, checked header. `header_len` is where the payload starts."""

    namespace: bytes
    key: bytes
    payload_len: int
    payload_crc: int
    header_len: int


def header_length(key_len: int, align: int = 1) -> int:
    """Bytes of the header for a key of `key_len` bytes, rounded up to `align`."""
    n = FIXED_HEADER_BYTES + key_len + _CRC.size
    return -(-n // align) * align


def encode_header(
    namespace: bytes, key: bytes, payload_len: int, payload_crc: int, *, align: int = 1
) -> bytes:
    """The header bytes of an entry (padded with zeros to a multiple of `align`)."""
    if len(namespace) != 32:
        raise ValueError(f"namespace must be a 32-byte digest, got {len(namespace)} bytes")
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    hlen = header_length(len(key), align)
    if hlen > 0xFFFF:
        raise ValueError(f"header of {hlen} bytes does not fit the 16-bit length field")
    fixed = _FIXED.pack(
        ENTRY_MAGIC, ENTRY_VERSION, hlen, 0, namespace, payload_len, payload_crc, len(key), 0
    )
    body = fixed + key
    return body + _CRC.pack(crc32c(body)) + bytes(hlen - len(body) - _CRC.size)


def check_header(
    buf: Buffer, *, namespace: bytes, key: bytes, payload_len: int | None = None
) -> EntryHeader | str:
    """Decodes the header at the start of `buf`; the header, or why it is not acceptable.

    `buf` must hold at least `header_length(len(key))` bytes (a short buffer is a
    reason, not an exception). `payload_len`, when given, must match the stored length.
    """
    mv = memoryview(buf).cast("B")  # type: ignore[arg-type]
    if len(mv) < FIXED_HEADER_BYTES:
        return "truncated header"
    magic, version, hlen, flags, ns, plen, pcrc, klen, reserved = _FIXED.unpack_from(mv)
    if magic != ENTRY_MAGIC:
        return "bad magic"
    if version != ENTRY_VERSION:
        return f"format version {version} (this reader knows {ENTRY_VERSION})"
    if flags or reserved:
        return f"unknown flags {flags:#x}/{reserved:#x}"
    if klen != len(key) or hlen < header_length(klen):
        return "key length mismatch"
    end = FIXED_HEADER_BYTES + klen
    if len(mv) < end + _CRC.size:
        return "truncated header"
    (hcrc,) = _CRC.unpack_from(mv, end)
    if crc32c(mv[:end]) != hcrc:
        return "header checksum mismatch"
    if ns != namespace:
        return "namespace mismatch"
    if mv[FIXED_HEADER_BYTES:end] != key:
        return "key mismatch"
    if payload_len is not None and plen != payload_len:
        return f"payload length {plen} != expected {payload_len}"
    return EntryHeader(ns, bytes(key), plen, pcrc, hlen)


def namespace_fields(
    config: OffloadingConfig,
    *,
    codec: str = "raw",
    rank: int | None = None,
    pages: object = None,
) -> dict[str, object]:
    """What an entry's bytes depend on, as a JSON-ready dict (the input of the digest).

    Args:
      config: the engine's offloading boundary.
      codec: the payload encoding (`CODECS`).
      rank: the worker whose bytes a payload holds, when each worker stores its own
        slice under the same key; None when a payload holds every worker's bytes of the
        chunk (vLLM's scheduler-side tiers, one JAX process driving the whole mesh).
      pages: how the engine's caches lay out a block's page, when the config does not
        say (a JAX engine's `GroupCaches`: `jax_kvoffload.assembly.engine_pages`); any
        JSON value. None: the config's `kv_cache_layout` says it (vLLM's engines).

    Topology (tp/pp/pcp/dcp sizes, world size) is left out when the bytes do not depend
    on it, with `rank=None`: canonical pages with `parallel.is_parallelism_agnostic`, a
    replicated layout, or one worker's direct pages (agnostic). Then an engine of another
    tensor-parallel size reads the same entries (vLLM's FileMapper rule, but for direct
    pages of several workers, whose rows another TP size arranges differently). The
    physical layout name is always in: vLLM leaves it out for the direct layout, where
    NHD and HND caches would read each other's bytes.
    """
    if not isinstance(config, OffloadingConfig):
        raise KVOffloadTypeError(
            f"config must be jax_kvoffload's OffloadingConfig, got {type(config).__name__} "
            "(vLLM's converts with jax_kvoffload.bridge.vllm.our_offloading_config)"
        )
    if not isinstance(codec, str) or codec not in CODECS:
        raise KVOffloadValueError(f"codec={codec!r} is not one of {CODECS}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise KVOffloadTypeError(f"rank must be None or an int, got {rank!r}")
    if rank is not None and rank < 0:
        raise KVOffloadValueError(f"rank must be None or an int >= 0, got {rank}")
    if pages is not None:
        try:
            json.dumps(pages, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise KVOffloadTypeError(f"pages must be a JSON value, got {pages!r}: {e}") from None
    portable = rank is None and (config.replicated_layout or _agnostic_rows(config))
    fields: dict[str, object] = {
        "model": config.model.name,
        "dtype": config.model.dtype,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "groups": [
            {
                "group_id": g.group_id,
                "tokens_per_block": g.tokens_per_block,
                "layers": list(g.layer_names),
            }
            for g in config.groups
        ],
        "kv_cache_layout": config.kv_cache_layout,
        "canonical_format": _canonical_format(config),
        "replicated_layout": config.replicated_layout,
        "codec": codec,
    }
    if pages is not None:  # absent otherwise: the digests of vLLM's engines stay as they are
        fields["pages"] = pages
    if not portable:
        p = config.parallel
        fields["topology"] = {
            "world_size": p.world_size,
            "tp": p.tp_size,
            "pp": p.pp_size,
            "pcp": p.pcp_size,
            "dcp": p.dcp_size,
            "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
            "rank": rank,
        }
    return fields


def _agnostic_rows(config: OffloadingConfig) -> bool:
    """Whether rows holding every worker's bytes of a chunk read the same at any TP size.

    vLLM's `is_parallelism_agnostic` claims it for direct pages too, but a row of direct
    pages holds each worker's slice of every layer in that worker's own area: at another
    TP size the same KV sits in other bytes of a row of the same length (an NHD engine at
    TP=4 would read a TP=2 engine's rows as its own, every CRC valid). So direct rows of
    several workers keep the topology; canonical pages, and one worker's pages, do not."""
    p = config.parallel
    return p.is_parallelism_agnostic and (config.canonical_layout or p.world_size <= 1)


def _canonical_format(config: OffloadingConfig) -> str | None:
    """The canonical byte format's id, or None for per-rank (direct) pages.

    Never None with `canonical_layout`: a config that names no `kv_cache_layout` (a JAX
    engine's: its `pages` say the encoding) gets `"v1-engine-pages"`, so a canonical entry
    and a per-rank one never share a namespace, even where the topology is left out."""
    if not config.canonical_layout:
        return None
    if config.kv_cache_layout is None:
        return f"v{CANONICAL_FORMAT_VERSION}-engine-pages"
    return canonical_format_id(config.kv_cache_layout)


def namespace_digest(
    config: OffloadingConfig, *, codec: str = "raw", rank: int | None = None, pages: object = None
) -> bytes:
    """SHA-256 (32 bytes) of `namespace_fields(...)` as canonical JSON.

    Entries of another namespace are misses. The first 8 bytes, in hex, name the
    namespace's directory on disk and appear in Redis keys.
    """
    text = json.dumps(
        namespace_fields(config, codec=codec, rank=rank, pages=pages),
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(b"jax_kvoffload.tiers/1\n" + text.encode()).digest()
