"""Pieces shared by the blockwise backends: static config, padding, the custom_vjp op,
and the per-block softmax arithmetic (plain jnp, usable inside Pallas kernels)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .spec import visible

NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static configuration of one attention call (hashable: a custom_vjp nondiff arg)."""

    scale: float
    softcap: float | None
    window: int | None
    block_q: int
    block_k: int
    interpret: Any = False


def block_mask(cfg: KernelConfig, qa, qd, qc, ka, kd, kc):
    """Visibility of a [bq, 1] query-metadata column against a [1, bk] key-metadata row."""
    return visible(qa, qd, qc, ka, kd, kc, cfg.window)


def scores(cfg: KernelConfig, s):
    """Scaled (+ softcapped) scores from raw q.k (f32). Returns (s, tanh term or None)."""
    s = s * cfg.scale
    if cfg.softcap is None:
        return s, None
    t = jnp.tanh(s / cfg.softcap)
    return cfg.softcap * t, t


def online_update(m, l, acc, s, mask, pv: Callable):
    """One flash-attention step. m, l [..., bq]; acc [..., bq, D]; s [..., bq, bk] (f32);
    mask broadcastable to s or None (full block); pv(p) -> [..., bq, D] f32 (p @ v)."""
    if mask is not None:
        s = jnp.where(mask, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
    p = jnp.exp(s - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    l_new = alpha * l + jnp.sum(p, axis=-1)
    acc_new = alpha[..., None] * acc + pv(p)
    return m_new, l_new, acc_new


def finalize(m, l, acc, sink=None):
    """-> (out f32 [..., bq, D], lse f32 [..., bq]); fully masked rows: out 0, lse -inf
    (lse = sink with sinks)."""
    if sink is not None:
        m_fin = jnp.maximum(m, sink)
        sc = jnp.exp(m - m_fin)
        l_fin = l * sc + jnp.exp(sink - m_fin)
        return acc * (sc / l_fin)[..., None], m_fin + jnp.log(l_fin)
    ok = l > 0
    inv = jnp.where(ok, 1.0 / jnp.where(ok, l, 1.0), 0.0)
    return acc * inv[..., None], jnp.where(ok, m + jnp.log(jnp.where(ok, l, 1.0)), NEG_INF)


def probs(s, lse_safe, mask):
    """Backward probabilities p = exp(s - lse) on visible entries (mask None = all)."""
    if mask is None:
        return jnp.exp(s - lse_safe[..., None])
    return jnp.where(mask, jnp.exp(jnp.where(mask, s, 0.0) - lse_safe[..., None]), 0.0)


def dscores(cfg: KernelConfig, p, dp, delta, t):
    """dL/d(raw q.k) (without the scale factor): p * (dp - delta) through the softcap."""
    ds = p * (dp - delta[..., None])
    if t is not None:
        ds = ds * (1.0 - t * t)
    return ds


def rowdot(a, b):
    """[B, Hq, Tq] f32 = sum_d a * b of two [B, Tq, Hq, D] arrays. Computed as "bth" and then moved:
    XLA's CPU backend runs the "bht" einsum and a plain multiply-sum as a much slower reduce."""
    out = jnp.einsum("bthd,bthd->bth", a.astype(jnp.float32), b.astype(jnp.float32))
    return jnp.moveaxis(out, 2, 1)


def safe_lse(lse):
    return jnp.where(jnp.isfinite(lse), lse, 0.0)


# ---------------------------------------------------------------------------------------
def make_op(fwd_impl, bwd_impl):
    """Wrap backend implementations into one differentiable op.

    fwd_impl(cfg, q, k, v, sinks, meta, sched) -> (out [B,Tq,Hq,D] q.dtype, lse [B,Hq,Tq] f32)
    bwd_impl(cfg, q, k, v, sinks, meta, sched, do, lse, delta) -> (dq, dk, dv)
    with ``delta = rowsum(dO * O) - dlse`` [B, Hq, Tq] f32 (dlse: cotangent of lse).
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def op(cfg, q, k, v, sinks, meta, sched):
        return fwd_impl(cfg, q, k, v, sinks, meta, sched)

    def op_fwd(cfg, q, k, v, sinks, meta, sched):
        out, lse = fwd_impl(cfg, q, k, v, sinks, meta, sched)
        return (out, lse), (q, k, v, sinks, meta, sched, out, lse)

    def op_bwd(cfg, res, cts):
        q, k, v, sinks, meta, sched, out, lse = res
        do, dlse = cts
        delta = rowdot(do, out)
        delta = delta - dlse.astype(jnp.float32)
        dq, dk, dv = bwd_impl(cfg, q, k, v, sinks, meta, sched, do, lse, delta)
        dsinks = None
        if sinks is not None:
            # d lse / d sink = p_sink; d out / d sink = -p_sink * out  =>  -p_sink * delta
            p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)
            dsinks = (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)
        zeros_like_int = jax.tree_util.tree_map(zero_cotangent, (meta, sched))
        return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dsinks, *zeros_like_int)

    op.defvjp(op_fwd, op_bwd)
    return op


def zero_cotangent(x):
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(jnp.shape(x), dtype=jax.dtypes.float0)


def pad_axis(x, axis: int, multiple: int, value=0):
    n = x.shape[axis]
    npad = -(-n // multiple) * multiple - n
    if npad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, npad)
    return jnp.pad(x, widths, constant_values=value)
