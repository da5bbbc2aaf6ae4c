"""A minimal paged serving loop around `DemoTransformer`, with the KV cache in a `KVOffloader`.

The offloader owns the cache arrays (a completed load replaces them), so every model
step takes them from `offloader.caches()`, donates them to the jitted step and hands the
updated ones back with `offloader.set_caches()`. Blocks come from a free list; a
request holds a block table (logical block -> cache block) until it is freed.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from jax_kvoffload.demo._config import DemoConfigError, Progress
from jax_kvoffload.demo._model import DemoTransformer, make_forward

logger = logging.getLogger(__name__)

#: `[num_blocks, 2, block_size, kv_heads, head_dim]` per layer, K/V stacked second.
CACHE_LAYOUT = pk.KVLayout.nhd(pk.KVStacking.SECOND)
#: By `DemoModelConfig.cache_layout`: the NHD one above, or tpu-inference's RPA v3 cache
#: `[num_blocks, block_size, 2 * kv_heads, 1, align(head_dim, 128)]` (uint32 words: one
#: slot per row, K of head h in slot 2h, V in 2h + 1, head_dim zero-padded to 128).
CACHE_LAYOUTS = {"nhd": CACHE_LAYOUT, "rpa": pk.KVLayout.rpa()}


class OutOfBlocksError(RuntimeError):
    """The free list cannot satisfy an allocation (raise `num_blocks`)."""


def block_hashes(tokens: Sequence[int], block_size: int, *, seed: bytes = b"") -> list[bytes]:
    """One hash per *full* block, chained: sha256(parent hash + the block's int32 tokens).

    A block's hash covers the whole prefix up to it, as vLLM's prefix-cache hashes do.
    """
    parent = hashlib.sha256(b"jax-kvoffload-demo" + seed).digest()
    out = []
    for b in range(len(tokens) // block_size):
        chunk = np.asarray(tokens[b * block_size : (b + 1) * block_size], dtype="<i4")
        parent = hashlib.sha256(parent + chunk.tobytes()).digest()
        out.append(parent)
    return out


def empty_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    layout: str = "nhd",
) -> list[jax.Array]:
    """Zeroed per-layer caches in `layout` (`CACHE_LAYOUTS`), uint32: "nhd"
    `[num_blocks, 2, block_size, kv_heads, head_dim]`, "rpa" tpu-inference's
    `pk.rpa_cache_shape` for 32-bit words (packing 1).

    Committed to the default device: loads return committed arrays, and a jitted step
    or kernel seen first with uncommitted ones would compile a second time.
    """
    if layout == "rpa":
        shape = pk.rpa_cache_shape(num_blocks, block_size, num_kv_heads, head_dim, jnp.uint32)
    else:
        shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    device = jax.devices()[0]
    return [jax.device_put(jnp.zeros(shape, jnp.uint32), device) for _ in range(num_layers)]


class BlockAllocator:
    """A free list of cache blocks. The most recently freed blocks are handed out first,
    so a freed request's blocks are the next ones overwritten."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(
                f"need {n} blocks but only {len(self._free)} of {self.num_blocks} are free; "
                "raise num_blocks"
            )
        return [self._free.pop() for _ in range(n)]

    def free(self, block_ids: Sequence[int]) -> None:
        self._free.extend(reversed(block_ids))


@dataclass
class Request:
    """One sequence: its tokens (prompt, then generated), block table, computed length."""

    name: str
    tokens: list[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0


class PagedServer:
    """Prefill / decode / free over a paged KV cache that a `KVOffloader` holds.

    Args:
      model: the transformer.
      offloader: holds the cache arrays (`caches()` / `set_caches()`).
      block_size: tokens per cache block.
      max_blocks_per_seq: block-table length; every step attends over this many blocks.
    """

    def __init__(
        self, model: DemoTransformer, offloader, *, block_size: int, max_blocks_per_seq: int
    ) -> None:
        self.offloader = offloader
        self.block_size = block_size
        self.max_blocks = max_blocks_per_seq
        num_blocks = CACHE_LAYOUT.num_blocks(tuple(offloader.caches()[0].shape))
        self.allocator = BlockAllocator(num_blocks)
        self._forward = make_forward(model)

    # -- blocks -------------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reserve(self, request: Request, num_tokens: int) -> None:
        """Makes the request's block table cover `num_tokens` tokens."""
        need = self.blocks_for(num_tokens)
        if need > self.max_blocks:
            raise DemoConfigError(
                f"request {request.name} needs {need} blocks; max_blocks_per_seq is "
                f"{self.max_blocks}"
            )
        if need > len(request.block_ids):
            request.block_ids += self.allocator.allocate(need - len(request.block_ids))

    def free(self, request: Request) -> None:
        self.allocator.free(request.block_ids)
        request.block_ids = []
        request.num_computed = 0

    # -- model steps --------------------------------------------------------------

    def prefill(self, request: Request, progress: Progress | None = None) -> np.ndarray:
        """Computes the prompt from `request.num_computed` on; returns the logits of the
        computed positions, `[len(tokens) - num_computed, vocab]` float32.

        Runs one block-aligned block at a time, so a prefill that starts after loaded
        prefix blocks performs exactly the float operations of a full one.
        """
        bs, start, n = self.block_size, request.num_computed, len(request.tokens)
        if start % bs:
            raise DemoConfigError(f"prefill must start on a block boundary, got {start}")
        self.reserve(request, n)
        first, last = start // bs, self.blocks_for(n)
        logits = []
        if progress is not None and last > first:  # started: the first step may compile
            progress(f"prefill {request.name}", 0, last - first)
        for b in range(first, last):
            chunk = request.tokens[b * bs : (b + 1) * bs]
            chunk = chunk + [0] * (bs - len(chunk))  # padding: written, never attended
            out = self._step(chunk, b * bs, min(n, (b + 1) * bs), request.block_ids)
            logits.append(out[: min(n, (b + 1) * bs) - b * bs])
            if progress is not None:
                progress(f"prefill {request.name}", b - first + 1, last - first)
        request.num_computed = n
        return np.concatenate(logits) if logits else np.zeros((0, 0), np.float32)

    def decode(
        self, request: Request, steps: int, first_logits: np.ndarray
    ) -> tuple[list[int], np.ndarray]:
        """Greedy decoding of `steps` tokens after a prefill whose last logits are
        `first_logits`; returns (tokens, logits `[steps, vocab]` of each step)."""
        generated, logits = [], []
        current = first_logits
        for _ in range(steps):
            token = int(np.argmax(current))
            generated.append(token)
            request.tokens.append(token)
            n = len(request.tokens)
            self.reserve(request, n)
            current = self._step([token], n - 1, n, request.block_ids)[0]
            logits.append(current)
            request.num_computed = n
        return generated, np.stack(logits) if logits else np.zeros((0, 0), np.float32)

    def _step(self, tokens: list[int], start: int, length: int, block_ids: list[int]):
        table = np.zeros(self.max_blocks, np.int32)  # unused entries: masked and zeroed
        table[: len(block_ids)] = block_ids
        caches = self.offloader.caches()
        logits, caches = self._forward(
            jnp.asarray(tokens, jnp.int32),
            caches,
            jnp.int32(start),
            jnp.int32(length),
            jnp.asarray(table),
        )
        self.offloader.set_caches(caches)
        return np.asarray(logits)
