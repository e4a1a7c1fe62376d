"""What every drafter network shares: the output record, the draft-vocabulary map `d2t` and
its helpers, and the head (final norm + lm_head) that turns pre-norm states into logits.
`DrafterModel` (EAGLE-3 / P-EAGLE) and `DFlashModel` both derive from `DraftHead`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from peagle_jax.models.layers import Attention


def layer_attention(cfg, index: int, in_features: int, *, dtype, param_dtype, rngs: nnx.Rngs) -> Attention:
    """The attention of drafter layer `index` (any head family): the config's heads, RoPE,
    bias, q/k norms and that layer's window, reading `in_features` (EAGLE-3's fused layer: 2H)."""
    return Attention(
        in_features,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        rope=cfg.rope,
        scale=cfg.attn_scale,
        bias=cfg.attention_bias,
        out_bias=cfg.attention_bias,
        qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None,
        window=cfg.window(index),
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
    )


class VocabMap(nnx.Variable):
    """A non-trainable int variable (the draft -> target id offsets `d2t`)."""


class DrafterOutput(NamedTuple):
    logits: jax.Array  # [B, T, Vd] float32
    prenorm: jax.Array  # [B, T, H] last layer output before the final norm
    cache: tuple | None  # per layer (k, v) [B, S, Hkv, D]; with `context`: this call's (k, v)


class DraftHead(nnx.Module):
    """The output side of a drafter: `self.norm`, `self.lm_head` [H -> Vd] and `self.d2t`."""

    def head(self, prenorm: jax.Array) -> jax.Array:
        """Draft-vocabulary logits (float32) of pre-norm states: lm_head(norm(prenorm)).
        Callers that need a few rows gather them first (the [T, Vd] product dominates)."""
        return self.lm_head(self.norm(prenorm)).astype(jnp.float32)

    def head_inputs(self, prenorm: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(norm(prenorm), lm_head kernel [H, Vd]), both in the head's compute dtype: what `head`
        multiplies, for losses that run the product themselves, chunk by chunk
        (`train.loss.fused_kl`: the [rows, Vd] logits never exist whole)."""
        dtype = self.lm_head.dtype or self.lm_head.kernel.dtype
        return self.norm(prenorm).astype(dtype), self.lm_head.kernel[...].astype(dtype)

    @property
    def t2d(self) -> jax.Array:
        return t2d_from_d2t(self.d2t[...], self.config.vocab_size)


# ---------------------------------------------------------------------------------------
# vocabulary
def draft_vocab_ids(d2t):
    """[Vd] target id of every draft id: arange(Vd) + d2t (numpy in, int64 numpy out;
    otherwise int32 jax). The one place the d2t offset convention is spelled out."""
    d2t = d2t[...] if isinstance(d2t, nnx.Variable) else d2t
    if isinstance(d2t, np.ndarray):
        return np.arange(d2t.shape[0], dtype=np.int64) + d2t.astype(np.int64)
    return jnp.arange(d2t.shape[0], dtype=jnp.int32) + jnp.asarray(d2t).astype(jnp.int32)


def draft_to_target(d2t, draft_ids: jax.Array) -> jax.Array:
    """target id = draft id + d2t[draft id] (int32), gathered for the given ids only (the
    engine calls it every round: no [Vd] table is built)."""
    d2t = d2t[...] if isinstance(d2t, nnx.Variable) else d2t
    ids = jnp.asarray(draft_ids).astype(jnp.int32)
    return ids + jnp.asarray(d2t)[ids].astype(jnp.int32)


def t2d_from_d2t(d2t, vocab_size: int):
    """Bool [V]: which target ids are in the draft vocabulary."""
    ids = draft_vocab_ids(d2t)
    if isinstance(ids, np.ndarray):
        out = np.zeros((vocab_size,), bool)
        out[ids] = True
        return out
    return jnp.zeros((vocab_size,), bool).at[ids].set(True)


def check_d2t(d2t: np.ndarray, vocab_size: int, where: str) -> None:
    """ValueError naming `where` unless d2t maps the draft ids into [0, V) one-to-one."""
    ids = draft_vocab_ids(np.asarray(d2t))
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size or np.unique(ids).size != ids.size):
        raise ValueError(f"{where}: d2t maps draft ids outside [0, {vocab_size}) or onto one target id twice")


def d2t_from_ids(used: Sequence[int] | np.ndarray) -> np.ndarray:
    """d2t [Vd] int64 from the sorted target ids of the draft vocabulary."""
    used = np.asarray(used, np.int64)
    return used - np.arange(used.shape[0], dtype=np.int64)


def select_draft_vocab(token_counts, size: int) -> np.ndarray:
    """Top-`size` target ids by count (ties: lower id first), sorted by id."""
    counts = np.asarray(token_counts)
    if counts.ndim != 1:
        raise ValueError(f"token_counts must be 1-D [V], got shape {counts.shape}")
    if not 0 < size <= counts.shape[0]:
        raise ValueError(f"draft vocab size {size} outside [1, {counts.shape[0]}]")
    order = np.lexsort((np.arange(counts.shape[0]), -counts.astype(np.float64)))
    return np.sort(order[:size]).astype(np.int64)
