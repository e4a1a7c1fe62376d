"""Dense attention over an explicit [B, Tq, Tk] mask: the one dense implementation.

It is the `"dense"` backend of `kernels.attention` (the models' default for decoding and
verification, where the key axis is a KV cache) and, run on float32 inputs at HIGHEST
precision, `kernels.reference` (the truth for every kernel test). Semantics as in
`kernels.reference`: GQA by consecutive groups, optional softcap, per-head sinks in the
denominator only, fully masked rows give out 0 and lse -inf (the sink with sinks).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["attention"]


def attention(q, k, v, mask, *, scale: float, softcap: float | None = None, sinks=None, precision=None):
    """q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D], mask [B, Tq, Tk] bool -> (out [B, Tq, Hq, D] in
    q.dtype, lse [B, Hq, Tq] f32). Scores and the softmax run in float32 whatever the input
    dtype; the probabilities are cast to v.dtype for the second product. Differentiable
    (masked scores never reach exp, so their gradient is exactly 0)."""
    b, tq, hq, d = q.shape
    hkv = k.shape[2]
    if hq % hkv:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    g = hq // hkv
    qg = q.reshape(b, tq, hkv, g, d)  # query head h reads kv head h // g (transformers' repeat_kv)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32, precision=precision) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    m = mask[:, None, None, :, :]
    mx = jnp.max(jnp.where(m, s, -jnp.inf), axis=-1)  # [B, Hkv, G, Tq]
    if sinks is not None:
        sk = jnp.asarray(sinks, jnp.float32).reshape(1, hkv, g, 1)
        mx = jnp.maximum(mx, sk)
    mx = lax.stop_gradient(jnp.where(jnp.isfinite(mx), mx, 0.0))
    p = jnp.where(m, jnp.exp(jnp.where(m, s, mx[..., None]) - mx[..., None]), 0.0)
    denom = jnp.sum(p, axis=-1)
    if sinks is not None:
        denom = denom + jnp.exp(sk - mx)
    safe = jnp.where(denom > 0, denom, 1.0)
    probs = (p / safe[..., None]).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32, precision=precision)
    lse = jnp.where(denom > 0, mx + jnp.log(safe), -jnp.inf)
    return out.reshape(b, tq, hq, d).astype(q.dtype), lse.reshape(b, hq, tq)
