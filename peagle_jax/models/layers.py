"""Building blocks shared by the target models and the drafter.

Hugging Face weight semantics throughout: rotate-half RoPE, unscaled q, kernels are the
transpose of PyTorch's [out, in] weights. Activations are [B, T, ...]; attention heads are
[B, T, heads, head_dim]. Norms and softmax run in float32 whatever the parameter dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

import kernels
from kernels import AttentionSpec
from peagle_jax.config.fields import ACTIVATION_NAMES
from peagle_jax.config.target_config import RopeConfig

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}
assert tuple(ACTIVATIONS) == ACTIVATION_NAMES, "config.ACTIVATION_NAMES names what this table implements"


# Attention over a KV cache: "decode" = `kernels.decode` (blocks up to the highest filled
# position: cost follows the filled length); "dense" = one [T, S] mask over every slot (the
# reference path; bench/decode_bench.py switches between the two). Read at trace time.
CACHE_ATTENTION = "decode"


class Linear(nnx.Linear):
    """`nnx.Linear` applied to the input flattened to [rows, features]: the same parameters and
    result, but XLA's CPU backend runs the weight gradient of a 2-D product as one fast GEMM,
    where a [B, T, features] input makes it an unfused transpose and a slower dot."""

    def __call__(self, inputs: jax.Array) -> jax.Array:
        lead = inputs.shape[:-1]
        return super().__call__(inputs.reshape(-1, inputs.shape[-1])).reshape(*lead, -1)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis; `offset=1` gives Gemma's (1 + w) scaling (w starts at 0)."""

    def __init__(self, dim: int, eps: float, *, offset: float = 0.0, param_dtype=jnp.float32, rngs=None):
        del rngs  # no randomness: ones (or zeros with an offset) like transformers
        init = jnp.zeros if offset else jnp.ones
        self.weight = nnx.Param(init((dim,), param_dtype))
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:  # Gemma scales in float32, then casts
            return scale_rows(y, self.offset + self.weight[...].astype(jnp.float32)).astype(x.dtype)
        return scale_rows(y.astype(x.dtype), self.weight[...])  # Llama casts, then scales


@jax.custom_vjp
def scale_rows(y: jax.Array, w: jax.Array) -> jax.Array:
    """y [..., H] * w [H], its weight gradient a [1, rows] x [rows, H] product: XLA's CPU backend
    runs the column sum inside the training step far below its speed alone."""
    return y * w


def _scale_rows_fwd(y, w):
    return y * w, (y, w)


def _scale_rows_bwd(res, g):
    y, w = res
    return (g * w).astype(y.dtype), column_sum(g * y).astype(w.dtype)


scale_rows.defvjp(_scale_rows_fwd, _scale_rows_bwd)


def column_sum(x: jax.Array) -> jax.Array:
    """x [..., F] summed over every leading axis, as a [1, rows] x [rows, F] product (see scale_rows)."""
    rows = x.reshape(-1, x.shape[-1])
    return jnp.dot(jnp.ones((1, rows.shape[0]), rows.dtype), rows, preferred_element_type=jnp.float32)[0]


@jax.custom_vjp
def pick_rows(per_position: jax.Array, slot: jax.Array, source: jax.Array) -> jax.Array:
    """[B, T, F]: row i is per_position[b, source[b, i]] ([B, L, F]), or `slot` [F] where
    source < 0. Its gradient: a scatter-add into the positions, and the slot's rows summed as
    one product (a column sum inside the step ran far below its speed alone, see scale_rows)."""
    return _pick(per_position, slot, source)


def _pick(per_position, slot, source):
    b, length, f = per_position.shape
    if length == 0:  # no positions: every row is the slot
        return jnp.broadcast_to(slot.astype(per_position.dtype), (*source.shape, f))
    idx = jnp.clip(source, 0, length - 1)
    rows = per_position[jnp.arange(b)[:, None], idx]
    return jnp.where((source >= 0)[..., None], rows, slot.astype(per_position.dtype))


def _pick_fwd(per_position, slot, source):
    return _pick(per_position, slot, source), (per_position.shape, slot, source)


def _pick_bwd(res, g):
    (b, length, f), slot, source = res
    real = (source >= 0)[..., None]
    d_slot = column_sum(jnp.where(real, 0, g)).astype(slot.dtype)
    idx = jnp.where(source >= 0, source, length)  # slot rows scatter past the end: dropped
    d_pos = jnp.zeros((b, length, f), g.dtype).at[jnp.arange(b)[:, None], idx].add(g, mode="drop")
    return d_pos, d_slot, None


pick_rows.defvjp(_pick_fwd, _pick_bwd)


def apply_rope(x: jax.Array, positions: jax.Array, rope: RopeConfig) -> jax.Array:
    """Rotate-half RoPE. x [B, T, heads, D], positions [B, T] (any int, padding included)."""
    inv_freq = jnp.asarray(rope.inv_freq(x.shape[-1]))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    scaling = rope.attention_scaling()
    if scaling != 1.0:  # yarn: transformers scales cos and sin in float32, then casts
        cos, sin = cos * scaling, sin * scaling
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def write_kv(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """Writes new [B, T, Hkv, D] into cache [B, S, Hkv, D] at index = position.

    Negative positions (padding) and positions past the cache are dropped, not wrapped.
    """
    size = cache.shape[1]
    idx = jnp.where((positions >= 0) & (positions < size), positions, size)
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, idx].set(new.astype(cache.dtype), mode="drop")


class Attention(nnx.Module):
    """Multi-head GQA attention with RoPE, optional q/k RMSNorm, bias and attention sinks.

    `in_features` may differ from the output width (the EAGLE-3 fused layer reads 2H).
    `bias` is for q/k/v; `out_bias` for o_proj (Hugging Face's Llama/Qwen3/Gemma 3 give o_proj
    a bias whenever `attention_bias` is set, so the target passes the same flag to both).
    `sinks` (GPT-OSS): a learned logit per query head that joins every softmax denominator.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        rope: RopeConfig,
        scale: float,
        bias: bool = False,
        out_bias: bool = False,
        qk_norm_eps: float | None = None,
        norm_offset: float = 0.0,
        softcap: float | None = None,
        window: int | None = None,
        sinks: bool = False,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        def linear(fin, fout, use_bias):
            return Linear(fin, fout, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        self.q_proj = linear(in_features, num_heads * head_dim, bias)
        self.k_proj = linear(in_features, num_kv_heads * head_dim, bias)
        self.v_proj = linear(in_features, num_kv_heads * head_dim, bias)
        self.o_proj = linear(num_heads * head_dim, out_features, out_bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, offset=norm_offset, param_dtype=param_dtype)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, offset=norm_offset, param_dtype=param_dtype)
        self.qk_norm = qk_norm_eps is not None
        if sinks:
            self.sinks = nnx.Param(jnp.zeros((num_heads,), param_dtype))
        self.has_sinks = sinks
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope, self.scale, self.softcap, self.window = rope, scale, softcap, window

    def heads(self, x: jax.Array):
        """q [B, T, Hq, D] and k, v [B, T, Hkv, D] before RoPE: projected, q and k normed."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def context_kv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(k, v) [B, S, Hkv, D] of rows that are keys only (DFlash's target context): this
        layer's k/v projections of `x`, k normed and rotated at `positions` - the `context` form."""
        b, s, _ = x.shape
        k = self.k_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            k = self.k_norm(k)
        return apply_rope(k, positions, self.rope), v

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        kv_cache: tuple[jax.Array, jax.Array] | None = None,
        spec: AttentionSpec | None = None,
        backend: str = "dense",
        context: tuple[jax.Array, jax.Array] | None = None,
    ):
        """`attend(heads(x), ...)`."""
        return self.attend(self.heads(x), positions, kv_cache, spec, backend, context)

    def attend(
        self,
        heads: tuple[jax.Array, jax.Array, jax.Array],
        positions: jax.Array,
        kv_cache: tuple[jax.Array, jax.Array] | None = None,
        spec: AttentionSpec | None = None,
        backend: str = "dense",
        context: tuple[jax.Array, jax.Array] | None = None,
    ):
        """Attention of the rows whose `heads` (q, k, v before RoPE) are given. Returns (output
        [B, T, out], new (k, v) cache or None; with `context`, this call's (k, v)).

        Without a cache the keys are this call's tokens; with one, the new keys are written
        at their positions first and the queries read the whole cache (index = position).
        `context` (k, v) [B, S, Hkv, D]: keys and values computed by earlier calls (projected and
        rotated), placed before this call's own; `spec`'s key metadata covers both (S + T rows).
        Attention is `kernels.attention` with `backend`: by default the positional causal rule
        (sliding window included); `spec` replaces it (the drafter's COD rows: the P-EAGLE rule
        from per-row metadata; with backend "auto" no [T, T] mask is ever built), with this
        layer's window. Over a cache with the positional rule, `kernels.decode` reads only the
        filled blocks (CACHE_ATTENTION).
        """
        q, k, v = heads
        q, k = apply_rope(q, positions, self.rope), apply_rope(k, positions, self.rope)
        if context is not None:
            if kv_cache is not None or spec is None:
                raise ValueError("Attention: context keys need a spec and no cache")
            keys = jnp.concatenate([context[0].astype(k.dtype), k], axis=1)
            values = jnp.concatenate([context[1].astype(v.dtype), v], axis=1)
            k_pos = None
        elif kv_cache is None:
            keys, values, k_pos = k, v, positions
        else:
            keys = write_kv(kv_cache[0], k, positions)
            values = write_kv(kv_cache[1], v, positions)
            k_pos = jnp.broadcast_to(jnp.arange(keys.shape[1]), keys.shape[:2])
        sinks = self.sinks[...] if self.has_sinks else None
        if kv_cache is not None and spec is None and CACHE_ATTENTION == "decode":
            # over a cache: read only the blocks up to the batch's highest position (or inside the
            # window), so a step's cost follows the filled length, not the cache's capacity
            out = kernels.decode.attention(
                q, keys, values, positions, scale=self.scale, softcap=self.softcap, sinks=sinks, window=self.window
            )
        else:
            if spec is None:
                spec = AttentionSpec.causal(
                    positions, k_pos, q_valid=positions >= 0, kv_valid=k_pos >= 0, sliding_window=self.window
                )
            spec = dataclasses.replace(spec, scale=self.scale, softcap=self.softcap, sliding_window=self.window)
            out = kernels.attention(q, keys, values, spec, sinks=sinks, backend=backend)
        b, t = q.shape[:2]
        new_cache = (k, v) if context is not None else None if kv_cache is None else (keys, values)
        return self.o_proj(out.reshape(b, t, -1)), new_cache

    def attend_slots(self, heads, slot_heads, spec: AttentionSpec, backend: str = "auto"):
        """Attention output [B, N, out] of the COD rows of `spec` (`AttentionSpec.peagle`, its
        `chain_depth` >= every row's depth) when a depth-0 row (anchor a) has the q, k, v of
        position a (`heads` [B, L, heads, D] before RoPE, position = index) and every deeper row
        the slot's (`slot_heads` [1, 1, heads, D]) at its reference position: `kernels.slot_attention`
        (the slot's keys are attended once per position, not once per row; exact for COD layouts,
        see `kernels.mask_slot`)."""
        q, k, v = heads
        b, length = q.shape[:2]
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))

        def rope(x, like):
            return apply_rope(jnp.broadcast_to(x.astype(like.dtype), like.shape), positions, self.rope)

        q_slot, k_slot, v_slot = slot_heads
        spec = dataclasses.replace(spec, scale=self.scale, softcap=self.softcap, sliding_window=self.window)
        out = kernels.slot_attention(
            rope(q, q),
            rope(k, k),
            v,
            rope(q_slot, q),
            rope(k_slot, k),
            jnp.broadcast_to(v_slot.astype(v.dtype), (b, 1, *v.shape[2:])),
            spec,
            sinks=self.sinks[...] if self.has_sinks else None,
            backend=backend,
        )
        return self.o_proj(out.reshape(*out.shape[:2], -1))


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU for Llama/Qwen, GeGLU for Gemma."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        act: str,
        *,
        bias: bool = False,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r} (supported: {', '.join(ACTIVATIONS)})")

        def linear(fin, fout):
            return Linear(fin, fout, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        self.gate_proj = linear(hidden, intermediate)
        self.up_proj = linear(hidden, intermediate)
        self.down_proj = linear(intermediate, hidden)
        self.act = act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(ACTIVATIONS[self.act](self.gate_proj(x)) * self.up_proj(x))
