"""The DFlash drafter network (docs/method.md, "DFlash"): one pass drafts a block of B - 1
tokens, every layer reading the target's context as extra keys and values.

```
ctx   = hidden_norm(fc(aux))                     # [.., n*Ht] -> [.., H]: one aux state per context layer
layer i: k_ctx, v_ctx = k_norm(k_proj(ctx)) (RoPE at the context positions), v_proj(ctx)
         h = h + o_proj(attn(q(h'), [k_ctx | k(h')], [v_ctx | v(h')]))   # h' = input_layernorm(h)
         h = h + mlp(post_attention_layernorm(h))                         # Qwen3 layers (q/k norms)
block = [bonus token, MASK x (B - 1)] at positions p .. p + B - 1 (the target's embeddings)
logits = lm_head(norm(h)) of slots 1..B-1     # slot k drafts the token at p + k
```
The context is keys only: it never runs through a layer, so its keys and values are a function
of the target's aux states alone (the engine caches them; `context_kv`). Attention is the block
rule (`kernels.AttentionSpec.block`): a block sees its document's context strictly before its
anchor p and all of its own rows, never another block.

Sliding layers (`DrafterConfig.layer_types`, speculators 0.9.0's `create_anchor_block_mask_mod`):
a block sees only the `sliding_window` W context rows before its anchor (p - W .. p - 1; every
row of the block the same ones), and its own rows causally, or all of them with
`sliding_window_non_causal`. The bidirectional form is the block rule with window W + 1 (`block_window`);
the causal one is two attentions merged by their log-sum-exps (`causal_block_attention`).

Inference (`write_context`, `draft_block`; the engine's mode "dflash"): the context K/V of
every token the target has run live in a position-indexed cache (`peagle_jax.engine.cache`); each
round writes the newly accepted tokens' K/V at their positions, then one pass runs the block
at the next position p over the cache. Entries at positions >= p (rejected drafts of earlier
rounds) are invisible under the block rule, so no crop is needed. A head whose every layer
slides (`DrafterConfig.context_window`) keeps a ring: slot = position mod the cache's length
(`engine.cache.drafter_length` sizes it), each slot read as the newest position before p that
maps to it; a rejected draft's slot then reads as a position older than the window.

Parameter names follow the checkpoint keys of both DFlash formats (speculators' and z-lab /
vLLM's), so `peagle_jax.formats.checkpoints` maps them one line per tensor. `embed_tokens` and `lm_head`
are the target's (frozen in training, as in speculators).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import kernels
from peagle_jax.config.drafter_config import DrafterConfig
from peagle_jax.models.head import DrafterOutput, DraftHead, VocabMap, layer_attention
from peagle_jax.models.layers import MLP, Attention, Linear, RMSNorm, apply_rope, write_kv


def block_window(cfg: DrafterConfig, index: int) -> int | None:
    """The block rule's window of DFlash layer `index` (None: full attention). speculators' window
    W shows a block the W context rows before its anchor p; the block rows hang off p - 1 at
    depth 1 (`AttentionSpec.block`), so the rule (`kernels.visible`) counts from p: W + 1."""
    w = cfg.window(index)
    return None if w is None else w + 1


def causal_block_specs(spec: kernels.AttentionSpec, context_len: int, block_size: int, window: int | None):
    """`spec` (`AttentionSpec.block` over [context | blocks]) split in two: the queries over the
    context alone (the window counted from the anchor, as the block rule does), and over their
    own block causally (row k at depth k + 1 of the block's chain: it sees rows 0..k)."""
    ctx = dataclasses.replace(
        spec,
        kv_anchor=spec.kv_anchor[:, :context_len],
        kv_depth=spec.kv_depth[:, :context_len],
        kv_doc=spec.kv_doc[:, :context_len],
        sliding_window=window,
    )
    depth = jnp.broadcast_to(1 + jnp.arange(spec.q_depth.shape[1], dtype=jnp.int32) % block_size, spec.q_depth.shape)
    own = dataclasses.replace(
        spec, q_depth=depth, kv_anchor=spec.q_anchor, kv_depth=depth, kv_doc=spec.q_doc, sliding_window=None
    )
    return ctx, own


def causal_block_attention(attn: Attention, x, positions, context, spec, backend: str, block_size: int):
    """A sliding layer's attention with causal blocks (speculators' `sliding_window_non_causal`
    false): no single row metadata shows every row of a block the same context window *and*
    its block causally, so the context and the block are attended apart, then merged."""
    q, k, v = attn.heads(x)
    q, k = apply_rope(q, positions, attn.rope), apply_rope(k, positions, attn.rope)
    ctx_spec, own_spec = causal_block_specs(spec, context[0].shape[1], block_size, attn.window)
    ctx_spec, own_spec = (dataclasses.replace(s, scale=attn.scale, softcap=attn.softcap) for s in (ctx_spec, own_spec))
    kc, vc = context[0].astype(k.dtype), context[1].astype(v.dtype)
    out1, lse1 = kernels.attention(q, kc, vc, ctx_spec, backend=backend, return_lse=True)
    out2, lse2 = kernels.attention(q, k, v, own_spec, backend=backend, return_lse=True)
    out, _ = kernels.chain.merge(out1, lse1, out2, lse2)
    b, t = q.shape[:2]
    return attn.o_proj(out.astype(q.dtype).reshape(b, t, -1))


class DFlashLayer(nnx.Module):
    """A Qwen3 decoder layer whose attention also reads the context's keys and values."""

    def __init__(self, cfg: DrafterConfig, index: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.self_attn = layer_attention(cfg, index, h, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.self_attn.window = block_window(cfg, index)  # the window in the block rule's terms
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.mlp = MLP(h, cfg.intermediate_size, cfg.hidden_act, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.causal, self.block_size = cfg.block_causal(index), cfg.block_size

    def __call__(self, x, positions, context, spec, backend):
        h = self.input_layernorm(x)
        if self.causal:
            attn = causal_block_attention(self.self_attn, h, positions, context, spec, backend, self.block_size)
        else:
            attn, _ = self.self_attn(h, positions, None, spec, backend, context)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashModel(DraftHead):
    """The DFlash network. Parameters (checkpoint names): embed_tokens [V, H], fc [n*Ht -> H],
    hidden_norm [H], layers.*, norm [H], lm_head [H -> Vd], d2t [Vd] (VocabMap, int32)."""

    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens = nnx.Embed(cfg.vocab_size, h, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.fc = Linear(cfg.fc_in, h, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.layers = nnx.List(
            [DFlashLayer(cfg, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(h, cfg.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = Linear(h, cfg.draft_vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.d2t = VocabMap(jnp.zeros((cfg.draft_vocab_size,), jnp.int32))

    def context(self, aux: jax.Array) -> jax.Array:
        """[..., n*Ht] aux states of the context positions -> [..., H]: hidden_norm(fc(aux))."""
        return self.hidden_norm(self.fc(aux.astype(self.fc.kernel.dtype)))

    def context_kv(self, ctx: jax.Array, positions: jax.Array) -> tuple:
        """Per layer (k, v) [B, S, Hkv, D] of context rows `ctx` [B, S, H] at `positions` [B, S]."""
        return tuple(layer.self_attn.context_kv(ctx, positions) for layer in self.layers)

    def block_inputs(self, bonus: jax.Array, block_size: int) -> jax.Array:
        """[B, n, block_size] token ids of blocks: each bonus token [B, n] then mask tokens."""
        masks = jnp.full((*bonus.shape, block_size - 1), self.config.mask_token_id, jnp.int32)
        return jnp.concatenate([bonus[..., None].astype(jnp.int32), masks], axis=-1)

    def write_context(self, cache: tuple, aux: jax.Array, positions: jax.Array) -> tuple:
        """`cache` (per layer (k, v) [B, S, Hkv, D], index = position, or position mod S for a
        ring) with the context K/V of the rows whose aux states are `aux` [B, R, n*Ht] written at
        `positions` [B, R] (-1: not written)."""
        new = self.context_kv(self.context(aux), positions)
        slots = ring_slots(positions, cache[0][0].shape[1]) if self.config.context_window else positions
        return tuple((write_kv(ck, k, slots), write_kv(cv, v, slots)) for (ck, cv), (k, v) in zip(cache, new))

    def draft_block(self, bonus: jax.Array, anchor: jax.Array, cache: tuple, backend: str = "auto") -> DrafterOutput:
        """One block [bonus, MASK x (B-1)] per row at positions anchor .. anchor + B - 1 over the
        cached context (`write_context`): rows see the cache strictly before `anchor` and their
        own block. bonus, anchor [B] (anchor -1: an idle row, its outputs are meaningless).
        Returns the `__call__` output over the B block rows (slot k >= 1 drafts position anchor + k)."""
        b, s = cache[0][0].shape[:2]
        size = self.config.block_size
        live = anchor >= 0
        positions = jnp.where(live[:, None], anchor[:, None] + jnp.arange(size), -1)
        ctx_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if self.config.context_window:  # a ring: slot j holds the newest position before p that maps to j
            ctx_pos = anchor[:, None] - 1 - (anchor[:, None] - 1 - ctx_pos) % s
        ctx_doc = jnp.where((ctx_pos >= 0) & (ctx_pos < anchor[:, None]), 0, -1)  # filled, accepted slots only
        spec = kernels.AttentionSpec.block(
            anchor[:, None], jnp.where(live, 0, -1)[:, None], ctx_pos, ctx_doc, block_size=size
        )
        return self(self.block_inputs(bonus, size), positions, cache, spec, backend)

    def __call__(self, tokens, positions, context, spec: kernels.AttentionSpec, backend: str = "dense"):
        """tokens, positions [B, Q] (block rows), `context` per layer (k, v) [B, S, Hkv, D];
        `spec` covers Q queries and S + Q keys ([context | blocks]). Returns DrafterOutput with
        logits [B, Q, Vd] for every row (slot 0's are the bonus token's, unused) and no cache."""
        x = self.embed_tokens(tokens)
        for layer, kv in zip(self.layers, context):
            x = layer(x, positions, kv, spec, backend)
        return DrafterOutput(self.head(x), x, None)


def ring_slots(positions: jax.Array, size: int) -> jax.Array:
    """Ring slots (position mod `size`) of one write's `positions` [B, R]; -1 (not written) for a
    position that a newer one of the same write takes the slot of (a prefill longer than the ring)."""
    newest = jnp.max(positions, axis=1, keepdims=True)
    keep = (positions >= 0) & (positions > newest - size)
    return jnp.where(keep, positions % size, -1)


def block_rows_states(
    model: DFlashModel,
    input_ids: jax.Array,
    aux: jax.Array,
    positions: jax.Array,
    doc: jax.Array,
    anchors: jax.Array,
    anchor_valid: jax.Array,
    mask: str = "dense",
) -> DrafterOutput:
    """The drafter over training blocks (speculators' packed form): the whole sequence is the
    context, each anchor a starts a block [input_ids[a], MASK x (B-1)] at positions
    positions[a] + 0..B-1 that sees the context of its document before a.

    input_ids [B, L] (unshifted: the token at each position), aux [B, L, n*Ht], positions and
    doc [B, L] (doc -1: padding), anchors [B, n] int (packed indices), anchor_valid [B, n] bool.
    Row j*B + k of the output is slot k of anchor j; slot k >= 1 drafts input_ids[a + k].
    `mask` "dense" builds the [Q, L + Q] mask; "kernels" runs `kernels.attention` block by block.
    """
    if mask not in ("dense", "kernels"):
        raise ValueError(f"block_rows_states: mask must be 'dense' or 'kernels', got {mask!r}")
    bs = model.config.block_size
    length = input_ids.shape[1]
    at = jnp.clip(anchors, 0, length - 1)
    take = jax.vmap(lambda x, i: x[i])
    block_doc = jnp.where(anchor_valid, take(doc, at), -1)
    tokens = model.block_inputs(take(input_ids, at), bs).reshape(anchors.shape[0], -1)
    block_pos = (take(positions, at)[..., None] + jnp.arange(bs)).reshape(anchors.shape[0], -1)
    spec = kernels.AttentionSpec.block(
        anchors, block_doc, jnp.broadcast_to(jnp.arange(length), doc.shape), doc, block_size=bs
    )
    context = model.context_kv(model.context(aux), positions)
    return model(tokens, block_pos, context, spec, "auto" if mask == "kernels" else "dense")
