"""A small Flax NNX decoder-only transformer that reads and writes a paged KV cache.

Random weights from a fixed seed; grouped-query attention; optional RoPE; float32
compute. The KV cache is one array per layer, `[num_blocks, 2, block_size, kv_heads,
head_dim]` (K and V stacked second, `pk.KVLayout.nhd(pk.KVStacking.SECOND)`), or with
`cache_layout="rpa"` tpu-inference's ragged-paged-attention v3 cache `[num_blocks,
block_size, 2 * kv_heads, 1, align(head_dim, 128)]` (K of head h in slot 2h, V in
2h + 1, head_dim zero-padded: `pk.KVLayout.rpa()`), stored as uint32 words holding the
float32 bits: XLA:CPU upcasts float scatters over the whole
operand, integer ones it does in place (docs/kernels.md), and the offloader moves words.

`forward` processes `T` tokens of one sequence at positions `start .. start+T-1`:
it writes their K/V into the paged cache, then attends over the sequence's whole block
table (a fixed `max_blocks * block_size` keys), masking keys after each query and
beyond `length`. A prefill runs it one block at a time (T = block_size, block-aligned),
a decode with T = 1. Every call of one shape performs the same float operations in the
same order whatever the physical block ids are, which is what makes a prefill that
starts from loaded prefix blocks bit-identical to a full recompute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_kvoffload.demo._config import DemoConfigError, DemoModelConfig

__all__ = ["DemoConfigError", "DemoModelConfig", "DemoTransformer", "make_forward"]


def _rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding of `x` `[T, heads, head_dim]` at `positions` `[T]`."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _words(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)


def _floats(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.float32)


class Block(nnx.Module):
    """Pre-norm attention (GQA) + SwiGLU MLP."""

    def __init__(self, cfg: DemoModelConfig, rngs: nnx.Rngs) -> None:
        d, hd = cfg.d_model, cfg.head_dim
        self.cfg = cfg
        self.attn_norm = nnx.RMSNorm(d, rngs=rngs)
        self.wq = nnx.Linear(d, cfg.num_heads * hd, use_bias=False, rngs=rngs)
        self.wk = nnx.Linear(d, cfg.num_kv_heads * hd, use_bias=False, rngs=rngs)
        self.wv = nnx.Linear(d, cfg.num_kv_heads * hd, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(cfg.num_heads * hd, d, use_bias=False, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d, rngs=rngs)
        self.w_gate = nnx.Linear(d, cfg.ffn_dim, use_bias=False, rngs=rngs)
        self.w_up = nnx.Linear(d, cfg.ffn_dim, use_bias=False, rngs=rngs)
        self.w_down = nnx.Linear(cfg.ffn_dim, d, use_bias=False, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        cache: jax.Array,
        positions: jax.Array,
        length: jax.Array,
        block_table: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        """x `[T, d]`, cache (uint32, `cfg.cache_layout`) -> (x, cache)."""
        cfg = self.cfg
        t, kvh, hd = x.shape[0], cfg.num_kv_heads, cfg.head_dim
        rpa = cfg.cache_layout == "rpa"
        bs = cache.shape[1] if rpa else cache.shape[2]
        h = self.attn_norm(x)
        q = self.wq(h).reshape(t, cfg.num_heads, hd)
        k = self.wk(h).reshape(t, kvh, hd)
        v = self.wv(h).reshape(t, kvh, hd)
        if cfg.rope:
            q = _rope(q, positions, cfg.rope_theta)
            k = _rope(k, positions, cfg.rope_theta)

        # Write this call's K/V into their slots: an integer scatter, in place under donation.
        blocks = block_table[positions // bs]
        slots = positions % bs
        if rpa:  # slot 2h: K of head h, 2h + 1: its V; lanes past hd stay zero
            cache = cache.at[blocks, slots, 0::2, 0, :hd].set(_words(k))
            cache = cache.at[blocks, slots, 1::2, 0, :hd].set(_words(v))
        else:
            cache = cache.at[blocks, 0, slots].set(_words(k))
            cache = cache.at[blocks, 1, slots].set(_words(v))

        # Read the sequence's whole block table back, as floats, in logical order.
        ctx = _floats(cache[block_table])
        if rpa:  # [max_blocks, bs, 2 * kvh, 1, D] -> K, V [max_blocks, bs, kvh, hd]
            k_ctx, v_ctx = ctx[:, :, 0::2, 0, :hd], ctx[:, :, 1::2, 0, :hd]
        else:  # [max_blocks, 2, bs, kvh, hd]
            k_ctx, v_ctx = ctx[:, 0], ctx[:, 1]
        keys = k_ctx.reshape(-1, kvh, hd)
        key_pos = jnp.arange(keys.shape[0], dtype=jnp.int32)
        # Slots past the sequence hold other requests' bits: zero them so they cannot
        # reach the output even as NaN (0 * NaN), whatever the block ids are.
        live = (key_pos < length)[:, None, None]
        keys = jnp.where(live, keys, 0.0)
        values = jnp.where(live, v_ctx.reshape(-1, kvh, hd), 0.0)

        group = cfg.num_heads // kvh
        qg = q.reshape(t, kvh, group, hd)
        scores = jnp.einsum("tkgd,skd->kgts", qg, keys) * (hd**-0.5)
        mask = key_pos[None, :] <= positions[:, None]  # [T, S]
        scores = jnp.where(mask, scores, -jnp.inf)
        probs = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = probs / probs.sum(axis=-1, keepdims=True)
        out = jnp.einsum("kgts,skd->tkgd", probs, values).reshape(t, cfg.num_heads * hd)
        x = x + self.wo(out)

        h = self.mlp_norm(x)
        x = x + self.w_down(nnx.silu(self.w_gate(h)) * self.w_up(h))
        return x, cache


class DemoTransformer(nnx.Module):
    """Embedding, `num_layers` blocks, final norm, untied LM head (float32)."""

    def __init__(self, cfg: DemoModelConfig) -> None:
        rngs = nnx.Rngs(cfg.seed)
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, rngs=rngs)
        self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, rngs=rngs)

    def __call__(
        self,
        tokens: jax.Array,
        caches: list[jax.Array],
        start: jax.Array,
        length: jax.Array,
        block_table: jax.Array,
    ) -> tuple[jax.Array, list[jax.Array]]:
        """tokens `[T]` at positions `start..start+T-1` -> (logits `[T, vocab]`, caches).

        `length` is the sequence length once these tokens are in (keys at or past it are
        ignored); `block_table` `[max_blocks]` int32 maps logical blocks to cache blocks.
        """
        positions = start + jnp.arange(tokens.shape[0], dtype=jnp.int32)
        x = self.embed(tokens)
        out = []
        for layer, cache in zip(self.layers, caches, strict=True):
            x, cache = layer(x, cache, positions, length, block_table)
            out.append(cache)
        return self.lm_head(self.norm(x)), out


def make_forward(model: DemoTransformer):
    """A jitted pure step `(tokens, caches, start, length, block_table) -> (logits, caches)`.

    The caches are donated (updated in place); one compile per token count `T`.
    """
    graphdef, state = nnx.split(model)

    def _step(state, tokens, caches, start, length, block_table):
        return nnx.merge(graphdef, state)(tokens, caches, start, length, block_table)

    step = jax.jit(_step, donate_argnums=(2,))

    def forward(tokens, caches, start, length, block_table):
        return step(state, tokens, caches, start, length, block_table)

    return forward
