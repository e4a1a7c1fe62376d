"""Pallas TPU kernel (Mosaic) for decode / verification attention over a KV cache.

Same contract as `kernels.decode.attention` (q [B, T, Hq, D], cache [B, S, Hkv, D] with
index = position, q_pos [B, T], -1 = padding row), with a cost that follows each batch row's
own filled length. Grid (batch, step): one program per batch row walks that row's KV blocks,
from the block of the lowest key any of its queries may see (``min pos - window + 1``, 0
without a window) to the block of its highest query position. The per-row bounds are
scalar-prefetched into SMEM; the K/V ``index_map`` turns the step into the row's block id,
and steps past the row's count repeat its last block (the pipeline issues no new copy) and
skip the compute (``pl.when``), as in `kernels.tpu`. The step axis is a dynamic grid bound,
the batch's longest range (``dynamic_grid=False``: the cache's block count). Each step DMAs
one contiguous [block, Hkv * D] slab of the cache (all KV heads of those slots: the cache is
viewed as [B, S, Hkv * D], no transpose) and runs, per KV head, the G query heads x T query
rows of its group as one [R, D] tile (row r = t * G + g, R a multiple of 16) with an online
softmax in f32 (m / l statistics as lane-replicated [R, 128] scratch; sinks join the
denominator at the last step).

Mosaic tiling: the key block is a multiple of 128 that divides the (128-padded) cache, so no
block is partial; a cache whose length is not a multiple of 128 is zero-padded (a copy: size
caches in multiples of 128). Head slices of the [block, Hkv * D] slab are lane-aligned when
D is a multiple of 128 (other D lower to unaligned lane slices). The [B, S, Hkv, D] ->
[B, S, Hkv * D] view is free in row-major order; whether XLA's TPU layout of the cache makes
it a copy is unmeasured. A cache slot outside its row's blocks is never read; slots inside a
read block but invisible to every query are masked (scores) and multiplied by probability 0,
so they must be finite.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _common as C
from .cost import attention_cost

__all__ = ["attention", "fit_block", "row_blocks", "DEFAULT_BLOCK", "LANES"]

DEFAULT_BLOCK = 512
LANES = 128
_NT = (((1,), (1,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))


def fit_block(block: int, s: int) -> int:
    """The KV block for a cache of ``s`` slots (s a multiple of 128): the largest multiple of
    128 that divides both ``block`` and ``s`` (no partial blocks)."""
    if block % LANES or block <= 0:
        raise ValueError(f"decode tpu: block={block} must be a positive multiple of {LANES}")
    return LANES * math.gcd(block // LANES, s // LANES)


def row_blocks(q_pos, s: int, bk: int, window: int | None):
    """Per batch row: (first block, block count, lowest visible key, highest query position)."""
    pos = jnp.asarray(q_pos, jnp.int32)
    valid = pos >= 0
    hi = jnp.max(jnp.where(valid, pos, -1), axis=1)
    if window is None:
        lo = jnp.zeros_like(hi)
    else:
        lo = jnp.maximum(jnp.min(jnp.where(valid, pos - (window - 1), s), axis=1), 0)
    first = jnp.minimum(lo, s - 1) // bk
    last = jnp.where(hi >= 0, jnp.minimum(hi // bk + 1, -(-s // bk)), first)
    return first, last - first, lo, hi


def _interpret(interpret):
    """True: TPU interpret mode (simulated SMEM/VMEM, DMAs, scalar prefetch); "generic": the
    plain Pallas interpreter (faster on CPU, same arithmetic); InterpretParams passed through."""
    if interpret is True:
        return pltpu.InterpretParams()
    if interpret == "generic":
        return True
    return interpret or False


def _dot(a, b, dims):
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _lanes(x, n):
    """[r, 128] lane-replicated -> [r, n] (n a multiple of 128, or <= 128)."""
    if n <= LANES:
        return x[:, :n]
    return jnp.tile(x, (1, n // LANES))


def _kernel(
    bounds_ref,
    pos_ref,
    sink_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    m_scr,
    l_scr,
    acc_scr,
    *,
    scale,
    softcap,
    window,
    bk,
    hkv,
    d,
):
    b, step = pl.program_id(0), pl.program_id(1)
    first, count = bounds_ref[2 * b], bounds_ref[2 * b + 1]
    r = q_ref.shape[1]

    @pl.when(step == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, C.NEG_INF, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(step < count)
    def _update():
        kpos = (first + step) * bk + lax.broadcasted_iota(jnp.int32, (r, bk), 1)
        qpos = _lanes(pos_ref[...], bk)  # [R, bk]
        see = kpos <= qpos
        if window is not None:
            see = see & (qpos - kpos < window)
        for h in range(hkv):
            cols = slice(h * d, (h + 1) * d)
            sc = _dot(q_ref[h], k_ref[:, cols], _NT) * scale  # [R, bk]
            if softcap is not None:
                sc = softcap * jnp.tanh(sc / softcap)
            sc = jnp.where(see, sc, C.NEG_INF)
            m_prev, l_prev = m_scr[h], l_scr[h]  # [R, 128]
            m_next = jnp.maximum(m_prev, jnp.max(sc, axis=-1)[:, None])
            m_safe = jnp.where(m_next == C.NEG_INF, 0.0, m_next)
            p = jnp.exp(sc - _lanes(m_safe, bk))
            alpha = jnp.exp(m_prev - m_safe)
            l_scr[h] = alpha * l_prev + jnp.sum(p, axis=-1)[:, None]
            m_scr[h] = m_next
            v = v_ref[:, cols]
            acc_scr[h] = _lanes(alpha, d) * acc_scr[h] + _dot(p.astype(v.dtype), v, _NN)

    @pl.when(step == pl.num_programs(1) - 1)
    def _end():
        for h in range(hkv):
            m, l = m_scr[h], l_scr[h]
            if sink_ref is not None:
                sink = sink_ref[h]  # [R, 128]
                m_fin = jnp.maximum(m, sink)
                corr = jnp.exp(m - m_fin)
                inv = corr / (l * corr + jnp.exp(sink - m_fin))
            else:
                ok = l > 0
                inv = jnp.where(ok, 1.0 / jnp.where(ok, l, 1.0), 0.0)
            o_ref[h] = (acc_scr[h] * _lanes(inv, d)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "window", "block", "interpret", "dynamic_grid"))
def attention(
    q,
    k_cache,
    v_cache,
    q_pos,
    *,
    scale: float,
    softcap: float | None = None,
    sinks=None,
    window: int | None = None,
    block: int = DEFAULT_BLOCK,
    interpret=False,
    dynamic_grid: bool = True,
):
    """q [B, T, Hq, D], k/v cache [B, S, Hkv, D], q_pos [B, T] (-1 = padding row) ->
    out [B, T, Hq, D] in q.dtype. ``interpret``: see `_interpret`. ``dynamic_grid``: the step
    axis runs to the batch's longest block range (a traced grid bound); False: to the cache's
    block count (static; skipped steps cost a little scalar work each)."""
    b, t, hq, d = q.shape
    hkv = k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    g = hq // hkv
    r = -(-t * g // 16) * 16
    k, v = (C.pad_axis(x, 1, LANES) for x in (k_cache, v_cache))
    s = k.shape[1]
    k, v = (x.reshape(b, s, hkv * d) for x in (k, v))
    bk = fit_block(block, s)
    first, count, _, _ = row_blocks(q_pos, s, bk, window)
    # dynamic: as many steps as the batch's longest block range; static: every block of the cache
    steps = jnp.maximum(jnp.max(count), 1) if dynamic_grid else s // bk
    bounds = jnp.stack([first, count], axis=1).reshape(-1).astype(jnp.int32)  # [2B]

    qg = jnp.transpose(q.reshape(b, t, hkv, g, d), (0, 2, 1, 3, 4)).reshape(b, hkv, t * g, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, r - t * g), (0, 0)))
    pos = jnp.pad(jnp.repeat(q_pos.astype(jnp.int32), g, axis=1), ((0, 0), (0, r - t * g)), constant_values=-1)
    pos = jnp.broadcast_to(pos[:, :, None], (b, r, LANES))
    sink_in = None
    if sinks is not None:
        sk = jnp.pad(jnp.tile(jnp.asarray(sinks, jnp.float32).reshape(hkv, g), (1, t)), ((0, 0), (0, r - t * g)))
        sink_in = jnp.broadcast_to(sk[:, :, None], (hkv, r, LANES))

    def kv_map(i, j, bref):
        return i, bref[2 * i] + jnp.minimum(j, jnp.maximum(bref[2 * i + 1] - 1, 0)), 0

    kernel = functools.partial(_kernel, scale=float(scale), softcap=softcap, window=window, bk=bk, hkv=hkv, d=d)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(b, steps),
        in_specs=[
            pl.BlockSpec((None, r, LANES), lambda i, j, bref: (i, 0, 0)),
            None if sink_in is None else pl.BlockSpec((hkv, r, LANES), lambda i, j, bref: (0, 0, 0)),
            pl.BlockSpec((None, hkv, r, d), lambda i, j, bref: (i, 0, 0, 0)),
            pl.BlockSpec((None, bk, hkv * d), kv_map),
            pl.BlockSpec((None, bk, hkv * d), kv_map),
        ],
        out_specs=pl.BlockSpec((None, hkv, r, d), lambda i, j, bref: (i, 0, 0, 0)),
        scratch_shapes=[
            pltpu.VMEM((hkv, r, LANES), jnp.float32),
            pltpu.VMEM((hkv, r, LANES), jnp.float32),
            pltpu.VMEM((hkv, r, d), jnp.float32),
        ],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((b, hkv, r, d), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=_interpret(interpret),
        name="peagle_decode_attention",
        cost_estimate=attention_cost("fwd", b, t, hq, s, hkv, d, q.dtype.itemsize, window),
    )(bounds, pos, sink_in, qg, k, v)
    out = jnp.transpose(out[:, :, : t * g].reshape(b, hkv, t, g, d), (0, 2, 1, 3, 4)).reshape(b, t, hq, d)
    return jnp.where((q_pos >= 0)[:, :, None, None], out, 0).astype(q.dtype)
