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

from . import dense
from .spec import AttentionSpec

__all__ = ["attention", "mask"]

HIGHEST = lax.Precision.HIGHEST


def mask(spec: AttentionSpec):
    """Dense [B, Tq, Tk] bool mask of ``spec``."""
    return spec.dense_mask()


def attention(q, k, v, spec: AttentionSpec, *, sinks=None):
    """Dense attention. q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D] -> (out [B,Tq,Hq,D] in q.dtype,
    lse [B, Hq, Tq] f32): `kernels.dense` on float32 inputs at HIGHEST precision. Differentiable
    by plain JAX autodiff (finite gradients everywhere, including fully masked rows)."""
    f32 = jnp.float32
    out, lse = dense.attention(
        q.astype(f32),
        k.astype(f32),
        v.astype(f32),
        spec.dense_mask(),
        scale=spec.resolved_scale(q.shape[-1]),
        softcap=spec.softcap,
        sinks=sinks,
        precision=HIGHEST,
    )
    return out.astype(q.dtype), lse
