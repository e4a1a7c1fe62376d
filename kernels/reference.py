"""Dense reference attention: f32, HIGHEST precision, the truth for every kernel test.

It materialises the [B, Hq, Tq, Tk] scores and the [B, Tq, Tk] mask, so it is for small
shapes only. Semantics shared by every backend:

* ``out[b, t, h] = sum_k p[b, h, t, k] v[b, k, h // G]`` with ``G = Hq // Hkv`` (consecutive
  GQA groups, like Hugging Face ``repeat_kv``), ``p`` the softmax over the visible keys of
  ``s = scale * q.k`` (``s = c * tanh(s / c)`` when ``softcap = c``).
* ``sinks`` [Hq] (optional): a per-head logit added to the softmax *denominator* only
  (GPT-OSS style): ``p_k = exp(s_k) / (sum_j exp(s_j) + exp(sink_h))``.
* ``lse[b, h, t] = log(sum_visible exp(s) + exp(sink_h))`` (natural log, f32). It includes
  the sink when sinks are given.
* Fully masked rows (padding rows, or rows that see no key): ``out = 0`` and
  ``lse = -inf`` (``lse = sink_h`` when sinks are given). Their gradients are 0.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .spec import AttentionSpec

__all__ = ["attention", "mask"]

HIGHEST = lax.Precision.HIGHEST


def mask(spec: AttentionSpec):
  """Dense [B, Tq, Tk] bool mask of ``spec``."""
  return spec.dense_mask()


def attention(q, k, v, spec: AttentionSpec, *, sinks=None):
  """Dense attention. q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D] -> (out [B,Tq,Hq,D] in q.dtype,
  lse [B, Hq, Tq] f32). Differentiable by plain JAX autodiff (finite gradients everywhere,
  including fully masked rows)."""
  B, Tq, Hq, D = q.shape
  Hkv = k.shape[2]
  if Hq % Hkv:
    raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
  G = Hq // Hkv
  scale = spec.resolved_scale(D)
  qf = q.astype(jnp.float32)
  kf = jnp.repeat(k.astype(jnp.float32), G, axis=2)
  vf = jnp.repeat(v.astype(jnp.float32), G, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", qf, kf, precision=HIGHEST) * scale
  if spec.softcap is not None:
    c = spec.softcap
    s = c * jnp.tanh(s / c)
  m = spec.dense_mask()[:, None, :, :]                       # [B, 1, Tq, Tk]
  mx = jnp.max(jnp.where(m, s, -jnp.inf), axis=-1)           # [B, H, Tq]
  if sinks is not None:
    sk = jnp.asarray(sinks, jnp.float32).reshape(1, Hq, 1)
    mx = jnp.maximum(mx, sk)
  mx = lax.stop_gradient(jnp.where(jnp.isfinite(mx), mx, 0.0))
  # double where: masked scores never reach exp, so their gradient is exactly 0
  p = jnp.where(m, jnp.exp(jnp.where(m, s, mx[..., None]) - mx[..., None]), 0.0)
  denom = jnp.sum(p, axis=-1)
  if sinks is not None:
    denom = denom + jnp.exp(sk - mx)
  safe = jnp.where(denom > 0, denom, 1.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", p / safe[..., None], vf, precision=HIGHEST)
  lse = jnp.where(denom > 0, mx + jnp.log(safe), -jnp.inf)
  return out.astype(q.dtype), lse
