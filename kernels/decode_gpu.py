"""Pallas GPU kernel (Triton lowering) for decode / verification attention over a KV cache.

Same contract as `kernels.decode.attention` (q [B, T, Hq, D], cache [B, S, Hkv, D] with
index = position, q_pos [B, T], -1 = padding row), with a cost that follows each batch row's
own filled length. Flash-decoding layout: grid (batch, KV head, row tile, split); a
program holds G query heads of its group times T query rows as one [R, D] tile (row
r = t * G + g; R a power of two, 16 <= R <= 64, more rows use several tiles), reads that
tile's query positions and derives in-kernel the batch row's KV block range [first, last):
from the lowest key any of its queries may see (``min pos - window + 1``, 0 without a
window) to its highest query position. The range is cut into ``num_splits`` contiguous
pieces, one per program (a `fori_loop` with dynamic bounds, online softmax in f32); the
partial (max, sum, acc) of the splits are merged by a few XLA ops on
[B, Hkv, splits, R, D] f32, where the sinks join the denominator.

The cache is read in place ([B, S, Hkv, D], no transposes or copies): the last partial
block of a cache that is not a block multiple is read from ``S - block`` (clamped,
the re-read keys masked), as in the XLA path. A cache slot outside the blocks of its row is
never read; slots inside a read block but invisible to every query are masked (scores) but
multiplied by probability 0, so they must be finite (stale drafts and zeros are). Triton
needs power-of-two tiles >= 16: the block is the largest power of two <= min(block, S);
head_dim is zero-padded to a power of two (a copy of the cache when D is not one: 64, 128
and 256 need none); caches shorter than 16 slots are zero-padded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import _common as C
from .cost import attention_cost

__all__ = ["attention", "fit_block", "num_splits_for", "DEFAULT_BLOCK"]

DEFAULT_BLOCK = 64
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b
MAX_ROWS = 64  # query rows (T x G) per program; more rows are split over programs
_TARGET_PROGRAMS = 128  # about one wave of programs on an H100 / H200 (132 SMs)
_MAX_SPLITS = 64


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _prev_pow2(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def fit_block(block: int, s: int) -> int:
    """The KV block for a cache of ``s`` slots (s >= 16): a power of two <= min(block, s)."""
    if block < 16 or block & (block - 1):
        raise ValueError(f"decode gpu: block={block} must be a power of two >= 16")
    return min(block, _prev_pow2(s))


def num_splits_for(b: int, hkv: int, n_blocks: int) -> int:
    """Splits of each row's block range: enough programs for about one wave of the device."""
    return max(1, min(-(-_TARGET_PROGRAMS // (b * hkv)), _MAX_SPLITS, n_blocks))


def _dot(a, b, dims):
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _kernel(pos_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, scale, softcap, window, bk, s, splits):
    split = pl.program_id(3)
    pos = pos_ref[...]  # [R] int32, -1 = padding
    q = q_ref[...]  # [R, D]
    hi = jnp.max(pos)
    lo = jnp.int32(0) if window is None else jnp.maximum(jnp.min(jnp.where(pos >= 0, pos - (window - 1), s)), 0)
    first = lax.div(jnp.minimum(lo, s - 1), bk)
    last = jnp.where(hi >= 0, jnp.minimum(lax.div(hi, bk) + 1, (s + bk - 1) // bk), first)
    per = lax.div(last - first + (splits - 1), splits)
    b0 = jnp.minimum(first + split * per, last)
    b1 = jnp.minimum(b0 + per, last)
    kidx = lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    qpos = pos[:, None]

    def body(i, carry):
        nominal = i * bk
        if s % bk:
            start = jnp.minimum(nominal, s - bk)  # the last block of a non-multiple cache: clamped
        else:
            start = pl.multiple_of(nominal, bk)
        sl = pl.ds(start, bk)
        sc = _dot(q, k_ref[sl, :], _NT) * scale
        if softcap is not None:
            sc = softcap * jnp.tanh(sc / softcap)
        kpos = start + kidx  # [1, bk]
        see = (kpos <= qpos) & (kpos >= nominal)
        if window is not None:
            see = see & (qpos - kpos < window)
        v = v_ref[sl, :]
        return C.online_update(*carry, sc, see, lambda p: _dot(p.astype(v.dtype), v, _NN))

    r, d = q.shape
    init = (jnp.full((r,), C.NEG_INF, jnp.float32), jnp.zeros((r,), jnp.float32), jnp.zeros((r, d), jnp.float32))
    m, l, acc = lax.fori_loop(b0, b1, body, init)
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _group_rows(q, q_pos, hkv: int, r: int, dp: int):
    """q [B, T, Hq, D] -> [B, Hkv, R, Dp] (row t * G + g), positions [B, R] (-1 padded)."""
    b, t, hq, d = q.shape
    g = hq // hkv
    qg = jnp.transpose(q.reshape(b, t, hkv, g, d), (0, 2, 1, 3, 4)).reshape(b, hkv, t * g, d)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, r - t * g), (0, dp - d)))
    pos = jnp.repeat(q_pos.astype(jnp.int32), g, axis=1)
    return qg, jnp.pad(pos, ((0, 0), (0, r - t * g)), constant_values=-1)


def _params(d: int, interpret):
    if interpret:
        return None
    return plgpu.CompilerParams(num_warps=4 if d <= 128 else 8, num_stages=2)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "window", "block", "num_splits", "interpret"))
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
    num_splits: int | None = None,
    interpret: bool = False,
):
    """q [B, T, Hq, D], k/v cache [B, S, Hkv, D], q_pos [B, T] (-1 = padding row) ->
    out [B, T, Hq, D] in q.dtype. ``num_splits``: programs per (batch, KV head) sharing a
    row's block range (default: about one wave of programs, `num_splits_for`)."""
    b, t, hq, d0 = q.shape
    s0, hkv = k_cache.shape[1], k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"Hq={hq} must be a multiple of Hkv={hkv}")
    g = hq // hkv
    dp = max(16, _next_pow2(d0))
    rt = min(max(16, _next_pow2(t * g)), MAX_ROWS)  # query rows per program
    n_rt = -(-t * g // rt)
    r = n_rt * rt
    k, v = k_cache, v_cache
    if s0 < 16:
        k, v = (C.pad_axis(x, 1, 16) for x in (k, v))
    if dp != d0:
        k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, dp - d0))) for x in (k, v))
    s = k.shape[1]
    bk = fit_block(block, s)
    splits = num_splits or num_splits_for(b * n_rt, hkv, -(-s // bk))
    qg, pos = _group_rows(q, q_pos, hkv, r, dp)

    kernel = functools.partial(_kernel, scale=float(scale), softcap=softcap, window=window, bk=bk, s=s, splits=splits)
    kv_spec = pl.BlockSpec((None, s, None, dp), lambda i, h, c, j: (i, 0, h, 0))
    stat_spec = pl.BlockSpec((None, None, None, rt), lambda i, h, c, j: (i, h, j, c))
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(b, hkv, n_rt, splits),
        in_specs=[
            pl.BlockSpec((None, rt), lambda i, h, c, j: (i, c)),
            pl.BlockSpec((None, None, rt, dp), lambda i, h, c, j: (i, h, c, 0)),
            kv_spec,
            kv_spec,
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rt, dp), lambda i, h, c, j: (i, h, j, c, 0)),
            stat_spec,
            stat_spec,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, hkv, splits, r, dp), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, splits, r), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, splits, r), jnp.float32),
        ],
        compiler_params=_params(dp, interpret),
        interpret=interpret,
        name="peagle_decode_attention",
        cost_estimate=attention_cost("fwd", b, t, hq, s, hkv, dp, q.dtype.itemsize, window),
    )(pos, qg, k, v)

    # merge the splits (flash-decoding's second pass), sinks in the denominator
    m_all = jnp.max(m, axis=2)  # [B, Hkv, R]
    w = jnp.exp(m - jnp.where(jnp.isfinite(m_all), m_all, 0.0)[:, :, None])  # 0 for empty splits
    l_all = jnp.sum(w * l, axis=2)
    acc_all = jnp.sum(w[..., None] * acc, axis=2)
    sink = None
    if sinks is not None:
        sk = jnp.asarray(sinks, jnp.float32).reshape(hkv, g)
        sink = jnp.pad(jnp.tile(sk, (1, t)), ((0, 0), (0, r - t * g)))[None]  # [1, Hkv, R]
    out, _ = C.finalize(m_all, l_all, acc_all, sink)  # [B, Hkv, R, Dp]
    out = out[:, :, : t * g, :d0].reshape(b, hkv, t, g, d0)
    out = jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(b, t, hq, d0)
    return jnp.where((q_pos >= 0)[:, :, None, None], out, 0.0).astype(q.dtype)
