"""Typed errors of the offloading boundary.

vLLM's `build_offloading_config` signals bad input with `ValueError`, with `TypeError`
(Python's `int()` on a list), and in several places with `assert`. Each condition raises
one of these classes instead, in the builtin family vLLM raises: a `ValueError` where
vLLM raises `ValueError` or asserts, a `TypeError` (`ConfigTypeError`) where it raises
`TypeError`, and `OverflowError` / `ZeroDivisionError` subclasses of `ChunkSizeError`
where Python's arithmetic raises those inside vLLM. Code written against vLLM's
exceptions keeps working; every class derives from the library root `KVOffloadError`,
carries the numbers involved as attributes, and keeps vLLM's wording so that messages
can be searched for in vLLM's issues.
"""

from __future__ import annotations


class KVOffloadError(Exception):
    """Root of every error jax_kvoffload raises on purpose (`except KVOffloadError`).

    Never raised itself: input errors are `KVOffloadValueError` / `KVOffloadTypeError`
    (a `ValueError` / `TypeError`, so code that catches the builtin keeps working) and
    errors of state (a closed object, a lost peer, a resource that ran out) are
    `KVOffloadStateError` (a `RuntimeError`). It lives in `config/` because every other
    package of ours may import `config` and `config` imports nothing of ours.
    """


class KVOffloadValueError(KVOffloadError, ValueError):
    """An argument has a wrong value; the message names it, shows it and gives the fix."""


class KVOffloadTypeError(KVOffloadError, TypeError):
    """An argument has a wrong type; the message names it and the type expected."""


class KVOffloadStateError(KVOffloadError, RuntimeError):
    """The call is valid but the object's state (or the machine's) does not allow it."""


class OffloadConfigError(KVOffloadValueError):
    """Base class of every error raised while building or validating a config."""


class ConfigFieldError(OffloadConfigError):
    """A constructor argument has a bad value; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ConfigTypeError(KVOffloadTypeError):
    """A config input has the wrong type; `field` names it (a `TypeError`).

    Raised by the config constructors and, as Python's `int()` does, for a list, dict or
    other non-number where `kv_connector_extra_config` needs an integer.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class MissingTransferConfigError(OffloadConfigError):
    """No KV transfer config, or one without an engine id (vLLM asserts)."""


class NoEligibleGroupsError(OffloadConfigError):
    """No KV cache group can be offloaded (vLLM: ValueError)."""

    def __init__(self) -> None:
        super().__init__(
            "KV offloading found no eligible cache groups. A group is offloaded when it "
            "allows KV transfer (enable_kv_transfer=True) and its spec is prefix-cacheable "
            "(not a circular buffer, bounded-replay or HiSparse spec); with HiSparse "
            "(hisparse_host_num_blocks set), only groups with role HISPARSE_INDEXER are."
        )


class PrefixMatchUnitError(OffloadConfigError):
    """`cache_config.prefix_match_unit` does not divide the group block sizes."""

    def __init__(self, message: str, *, prefix_match_unit: int, block_sizes: tuple[int, ...]):
        super().__init__(message)
        self.prefix_match_unit = prefix_match_unit
        self.block_sizes = block_sizes


class StateAlignmentError(OffloadConfigError):
    """Prefix-cache boundaries do not align with a spec's per-state compression."""

    def __init__(self, message: str, *, alignment: int, alignments: tuple[int, ...]):
        super().__init__(message)
        self.alignment = alignment
        self.alignments = alignments


class TokensPerHashError(OffloadConfigError):
    """A group's tokens per block is not a multiple of tokens per hash (vLLM asserts)."""

    def __init__(self, *, group_id: int, tokens_per_block: int, tokens_per_hash: int) -> None:
        super().__init__(
            f"tokens_per_block={tokens_per_block} not divisible by "
            f"tokens_per_hash={tokens_per_hash}. "
            "Hybrid models (e.g. Mamba+Attention) need "
            "--enable-prefix-caching to align block sizes."
        )
        self.group_id = group_id
        self.tokens_per_block = tokens_per_block
        self.tokens_per_hash = tokens_per_hash


class ChunkSizeError(OffloadConfigError):
    """`block_size` / `blocks_per_chunk` in the extra config are inconsistent."""


class ChunkSizeOverflowError(ChunkSizeError, OverflowError):
    """A chunk option is an infinite float: vLLM's `int()` raises `OverflowError` there,
    so this is one too (and a `ChunkSizeError`)."""


class ZeroChunkSizeError(ChunkSizeError, ZeroDivisionError):
    """`block_size: 0` gave 0 tokens per chunk and a window group needs to divide by it;
    vLLM divides by zero there, so this is a `ZeroDivisionError` too."""


class NonUniformBlockSizeError(ChunkSizeError):
    """`block_size` given, but the offloaded groups differ in block size (vLLM asserts)."""

    def __init__(self, tokens_per_block: tuple[int, ...]) -> None:
        super().__init__(
            "If 'block_size' is specified in kv_connector_extra_config, "
            "there must be at least one KV cache group, "
            "and all groups must have the same block size. "
            f"Got group block sizes {list(tokens_per_block)}; "
            "set 'blocks_per_chunk' instead."
        )
        self.tokens_per_block = tokens_per_block


class ChunkMultipleError(ChunkSizeError):
    """`block_size` is not a multiple of the GPU block size; `suggested` is the fix."""

    def __init__(self, *, tokens_per_chunk: int, tokens_per_block: int, suggested: int) -> None:
        super().__init__(
            f"'block_size'={tokens_per_chunk} in kv_connector_extra_config "
            f"must be a multiple of the GPU KV cache block size "
            f"({tokens_per_block} tokens). Use "
            f"{suggested} instead, or set "
            f"'blocks_per_chunk' to express the chunk size in blocks."
        )
        self.tokens_per_chunk = tokens_per_chunk
        self.tokens_per_block = tokens_per_block
        self.suggested = suggested


class WindowSpecError(OffloadConfigError):
    """A selected group's spec has no defined window in chunks (vLLM asserts)."""
