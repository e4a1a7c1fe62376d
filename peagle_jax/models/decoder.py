"""The decoder-only target model shared by every supported family (Llama, Qwen3, Gemma 3,
Qwen3-MoE, GPT-OSS).

Family differences are `TargetConfig` flags; parameter names follow the Hugging Face
module tree (without the `model.` prefix) so the weight maps stay one line per tensor.
A layer's feed-forward is a gated MLP or, where `cfg.mlp_types` says "moe", `models.moe.MoE`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kernels
from peagle_jax.config.target_config import TargetConfig
from peagle_jax.models.layers import MLP, Attention, Linear, RMSNorm
from peagle_jax.models.moe import MoE
from peagle_jax.models.rows import keep_rows


class DecoderOutput(NamedTuple):
    logits: jax.Array | None  # [B, T, V] (or [B, n, V] at `logits_at`)
    aux_hidden: jax.Array  # [B, T, len(aux_layer_ids) * H]
    hidden: jax.Array  # [B, T, H] final-norm output (lm_head input)
    cache: tuple | None  # per layer (k, v), each [B, S, Hkv, D]


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TargetConfig, layer: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        h = cfg.hidden_size

        def norm():
            return RMSNorm(h, cfg.rms_norm_eps, offset=cfg.norm_offset, param_dtype=param_dtype)

        self.input_layernorm = norm()
        self.self_attn = Attention(
            h,
            h,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            rope=cfg.layer_rope(layer),
            scale=cfg.attn_scale,
            bias=cfg.attention_bias,
            out_bias=cfg.attention_bias,  # HF: o_proj bias = attention_bias too
            qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None,
            norm_offset=cfg.norm_offset,
            softcap=cfg.attn_logit_softcapping,
            window=cfg.window(layer),
            sinks=cfg.attention_sinks,
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.post_attention_layernorm = norm()
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.sandwich = cfg.sandwich_norms
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        else:
            self.mlp = MLP(
                h,
                cfg.intermediate_size,
                cfg.hidden_act,
                bias=cfg.mlp_bias,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
            )

    def __call__(self, x, positions, kv_cache=None, backend="dense"):
        attn, kv_cache = self.self_attn(self.input_layernorm(x), positions, kv_cache, None, backend)
        if self.sandwich:
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), kv_cache
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class Decoder(nnx.Module):
    def __init__(self, cfg: TargetConfig, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List(
            [DecoderLayer(cfg, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=cfg.norm_offset, param_dtype=param_dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(
                cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs
            )

    def embed(self, tokens: jax.Array) -> jax.Array:
        x = self.embed_tokens(tokens)
        if self.config.embed_scale != 1.0:  # Gemma: the scale is cast to the embedding dtype first
            x = x * jnp.asarray(self.config.embed_scale, x.dtype)
        return x

    def lm_logits(self, hidden: jax.Array) -> jax.Array:
        """Logits (float32) from final-norm hidden states."""
        if self.config.tie_word_embeddings:
            logits = self.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        logits = logits.astype(jnp.float32)
        cap = self.config.final_logit_softcapping
        return cap * jnp.tanh(logits / cap) if cap else logits

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: tuple | None = None,
        *,
        aux_layer_ids: tuple[int, ...] = (),
        logits_at: jax.Array | None = None,
        compute_logits: bool = True,
    ) -> DecoderOutput:
        """tokens, positions [B, T]; position -1 marks a padding slot (no KV write, output 0).

        `cache`: per-layer (k, v) [B, S, Hkv, D], index = position; None = attend within
        this call only. `logits_at` [B, n] picks the rows that get logits (saves the
        [T, V] product at prefill).
        """
        x = keep_rows(self.embed(tokens))
        aux, new_cache = [], []
        # without a cache (training features, scoring): the blockwise kernels past DENSE_MAX_ROWS
        # tokens, so a long sequence's attention needs no [T, T] scores (quadratic memory)
        long = cache is None and tokens.shape[1] > kernels.DENSE_MAX_ROWS
        for i, layer in enumerate(self.layers):
            if i in aux_layer_ids:
                aux.append((aux_layer_ids.index(i), x))
            x, kv = layer(x, positions, None if cache is None else cache[i], "auto" if long else "dense")
            x = keep_rows(x)
            new_cache.append(kv)
        hidden = self.norm(x)
        aux_hidden = jnp.concatenate([a for _, a in sorted(aux, key=lambda p: p[0])], axis=-1) if aux else x[..., :0]
        logits = None
        if compute_logits:
            rows = hidden if logits_at is None else jnp.take_along_axis(hidden, logits_at[..., None], axis=1)
            logits = self.lm_logits(rows)
        return DecoderOutput(logits, aux_hidden, hidden, None if cache is None else tuple(new_cache))


def embedding_arrays(graphdef, state, scaled: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(input embedding [V, H] as the first layer sees it, lm_head weight [V, H] (the embedding
    when tied)), float32 host copies. Gemma's sqrt(H) scale is applied the way `Decoder.embed`
    does (cast to the weight dtype first); `scaled=False`: the stored embedding rows."""
    model = nnx.merge(graphdef, state)
    raw = model.embed_tokens.embedding[...]
    emb = np.asarray(jax.device_get(raw)).astype(np.float32)
    cfg = model.config
    head = (
        emb if cfg.tie_word_embeddings else np.asarray(jax.device_get(model.lm_head.kernel[...])).astype(np.float32).T
    )
    if scaled and cfg.embed_scale != 1.0:
        emb = emb * np.float32(jnp.asarray(cfg.embed_scale, raw.dtype))
    return emb, head
