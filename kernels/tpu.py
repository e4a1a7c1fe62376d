"""Pallas TPU (Mosaic) kernels for block-sparse attention.

The schedule is scalar-prefetched into SMEM: for each (batch, query block) up to R
KV-block ranges (starts, step offsets), the step count and the full-block range. Grid
(batch, head, query block, step); the K/V ``index_map`` turns the step into a KV block id,
so only scheduled KV blocks are DMA'd; steps past the count repeat the last block id
(the pipeline then issues no new copy) and skip compute with ``pl.when``. Full blocks skip
the mask arithmetic. dQ uses the same grid; dK/dV uses grid (batch, KV head, KV block,
group head, step) over the transposed schedule and accumulates the G query heads of a
group into one f32 scratch (GQA gradients summed in-kernel).

Layouts follow the proven splash-attention patterns: q/k/v as [B, H, T, D]; per-row
metadata as lane-replicated columns [B, 3, T, 128] and sublane-replicated rows
[B, 3, 8, T]; m/l statistics as [block, 128] lane-replicated scratch; lse written
lane-replicated and read back as rows. Block sizes must be multiples of 128.

The grid's step axis has the static worst-case length (number of KV blocks): skipped
steps cost a little scalar work each (no DMA, no MXU work). SMEM holds
B * nQ * (2R + 3) int32 for the schedule.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _common as C
from . import limits
from .cost import attention_cost
from .schedule import range_offsets

__all__ = ["op", "fit_blocks", "vmem_bytes", "attention_fwd", "attention_bwd", "LANES"]

LANES = 128
SUBLANES = 8
_NT = (((1,), (1,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))


def vmem_bytes(block_q: int, block_k: int, head_dim: int, itemsize: int) -> int:
    """VMEM of the largest kernel (dK/dV): q, dO, k, v blocks in and dk, dv out, double-buffered;
    two [block, D] f32 scratches; two f32 [block_q, block_k] score-sized temporaries; the
    lane-replicated metadata columns, double-buffered. A budget, checked by the TPU compiler
    (tests/compile/)."""
    io = 2 * itemsize * head_dim * (2 * block_q + 4 * block_k)
    scratch = 2 * 4 * head_dim * max(block_q, block_k)
    tiles = 2 * 4 * block_q * block_k
    meta = 2 * 4 * 3 * LANES * (block_q + block_k)
    return io + scratch + tiles + meta


# SMEM for the scalar-prefetched schedule: 3/4 of a TensorCore's 1 MiB (the kernels' other scalars
# take the rest); a v5p refused the dK/dV kernel of a 1,048,576-token sequence at 128-row blocks
# (1,157,120 bytes of SMEM operands)
SCHEDULE_SMEM = 3 << 18


def schedule_bytes(rows: int, T: int, block: int, ranges: int) -> int:
    """SMEM of one schedule: per (row, block of T) `ranges` (start, offset) pairs, the step count
    and the full-block range."""
    return 4 * rows * -(-T // block) * (2 * ranges + 3)


def fit_blocks(block_q: int, block_k: int, Tq: int, Tk: int, head_dim=128, itemsize=2, rows=1, ranges=16):
    """Multiples of 128, no larger than needed for short sequences, halved (the larger first)
    until `vmem_bytes` fits the traced-for TPU's scoped VMEM (`kernels.limits`), then doubled
    while the schedules of `rows` rows (the forward's over query blocks, dK/dV's over KV blocks)
    outgrow SCHEDULE_SMEM; None when no size fits both."""
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if b % LANES:
            raise ValueError(f"tpu backend: {name}={b} must be a multiple of {LANES}")

    def ceil(n):
        return -(-n // LANES) * LANES

    def half(b):
        return max(LANES, b // 2 // LANES * LANES)

    bq, bk = min(block_q, ceil(Tq)), min(block_k, ceil(Tk))
    limit = limits.current("tpu").vmem_bytes
    while vmem_bytes(bq, bk, head_dim, itemsize) > limit and (bq, bk) != (LANES, LANES):
        bq, bk = (half(bq), bk) if bq >= bk else (bq, half(bk))
    while schedule_bytes(rows, Tq, bq, ranges) > SCHEDULE_SMEM and bq < ceil(Tq):
        bq = min(2 * bq, ceil(Tq))
    while schedule_bytes(rows, Tk, bk, ranges) > SCHEDULE_SMEM and bk < ceil(Tk):
        bk = min(2 * bk, ceil(Tk))
    if vmem_bytes(bq, bk, head_dim, itemsize) > limit:
        return None
    return bq, bk


def _interpret(cfg):
    """interpret=True: TPU interpret mode (simulates SMEM/VMEM, DMAs, scalar prefetch);
    "generic": the plain Pallas interpreter (much faster on CPU, same arithmetic);
    an InterpretParams instance is passed through."""
    it = cfg.interpret
    if it is True:
        return pltpu.InterpretParams()
    if it == "generic":
        return True
    return it or False


def _dot(a, b, dims):
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _pack_sched(ranges, count, full):
    """-> flat int32 [B * n * (2R + 3)]: R starts, R step offsets, count, full start/end."""
    st, off, _ = range_offsets(ranges)
    packed = jnp.concatenate([st, off, count[..., None], full], axis=-1).astype(jnp.int32)
    return packed.reshape(-1), packed.shape[-1]


def _visit(active, full, update) -> None:
    """Runs `update(masked)` for a scheduled block: full blocks skip the mask arithmetic."""
    pl.when(active & full)(lambda: update(False))
    pl.when(active & jnp.logical_not(full))(lambda: update(True))


def _block_at(sched_ref, base, s, R):
    """KV (or Q) block id visited at step s (clamped to the last scheduled block)."""
    cnt = sched_ref[base + 2 * R]
    sc = jnp.minimum(s, jnp.maximum(cnt - 1, 0))
    blk = sched_ref[base] + sc - sched_ref[base + R]
    for r in range(1, R):
        off = sched_ref[base + R + r]
        blk = jnp.where(sc >= off, sched_ref[base + r] + sc - off, blk)
    return blk


def _meta_cols(meta3, T):
    """3 x [B, T] -> [B, 3, T, 128] lane-replicated columns."""
    x = jnp.stack(meta3, axis=1)
    return jnp.broadcast_to(x[..., None], x.shape + (LANES,))


def _meta_rows(meta3, T):
    """3 x [B, T] -> [B, 3, 8, T] sublane-replicated rows."""
    x = jnp.stack(meta3, axis=1)
    return jnp.broadcast_to(x[:, :, None, :], (x.shape[0], 3, SUBLANES, x.shape[-1]))


def _lanes(x, n):
    """[r, 128] lane-replicated -> [r, n] (n a multiple of 128, or <= 128)."""
    if n <= LANES:
        return x[:, :n]
    return jnp.tile(x, (1, n // LANES))


def _mask_k_in_lanes(cfg, qcol_ref, krow_ref, bk):
    """[bq, bk] mask: query metadata as columns, key metadata as rows."""
    q3 = [_lanes(qcol_ref[c], bk) for c in range(3)]
    k3 = [krow_ref[c, :1, :] for c in range(3)]
    return C.block_mask(cfg, *q3, *k3)


def _mask_q_in_lanes(cfg, qrow_ref, kcol_ref, bq):
    """[bk, bq] (transposed) mask: key metadata as columns, query metadata as rows."""
    k3 = [_lanes(kcol_ref[c], bq) for c in range(3)]
    q3 = [qrow_ref[c, :1, :] for c in range(3)]
    return C.block_mask(cfg, *q3, *k3)


# ---------------------------------------------------------------------------------------
def _fwd_kernel(
    sched_ref,
    sinks_ref,
    qcol_ref,
    krow_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    lse_ref,
    m_scr,
    l_scr,
    acc_scr,
    *,
    cfg,
    nQ,
    R,
    W,
    S,
):
    b, h, i, s = (pl.program_id(a) for a in range(4))
    bk = cfg.block_k
    D = acc_scr.shape[-1]
    base = (b * nQ + i) * W
    cnt = sched_ref[base + 2 * R]

    @pl.when(s == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, C.NEG_INF, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    j = _block_at(sched_ref, base, s, R)
    full = (j >= sched_ref[base + 2 * R + 1]) & (j < sched_ref[base + 2 * R + 2])

    def update(masked: bool):
        sc, _ = C.scores(cfg, _dot(q_ref[...], k_ref[...], _NT))  # [bq, bk]
        if masked:
            mask = _mask_k_in_lanes(cfg, qcol_ref, krow_ref, bk)
            sc = jnp.where(mask, sc, C.NEG_INF)
        m_prev, l_prev = m_scr[...], l_scr[...]  # [bq, 128]
        m_next = jnp.maximum(m_prev, jnp.max(sc, axis=-1)[:, None])
        m_safe = jnp.where(m_next == C.NEG_INF, 0.0, m_next)
        p = jnp.exp(sc - _lanes(m_safe, bk))
        alpha = jnp.exp(m_prev - m_safe)
        l_scr[...] = alpha * l_prev + jnp.sum(p, axis=-1)[:, None]
        m_scr[...] = m_next
        v = v_ref[...]
        acc_scr[...] = _lanes(alpha, D) * acc_scr[...] + _dot(p.astype(v.dtype), v, _NN)

    _visit(s < cnt, full, update)

    @pl.when(s == S - 1)
    def _end():
        m, l = m_scr[...], l_scr[...]
        if sinks_ref is not None:
            sink = sinks_ref[0, h]
            m_fin = jnp.maximum(m, sink)
            sc = jnp.exp(m - m_fin)
            l_fin = l * sc + jnp.exp(sink - m_fin)
            o_ref[...] = (acc_scr[...] * _lanes(sc / l_fin, D)).astype(o_ref.dtype)
            lse_ref[...] = m_fin + jnp.log(l_fin)
        else:
            ok = l > 0
            l1 = jnp.where(ok, l, 1.0)
            inv = jnp.where(ok, 1.0 / l1, 0.0)
            o_ref[...] = (acc_scr[...] * _lanes(inv, D)).astype(o_ref.dtype)
            lse_ref[...] = jnp.where(ok, m + jnp.log(l1), C.NEG_INF)


def attention_fwd(cfg: C.KernelConfig, q, k, v, sinks, meta, sched):
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bq, bk = cfg.block_q, cfg.block_k
    nQ, nK = Tq // bq, Tk // bk
    R = sched.fwd_ranges.shape[-2]
    packed, W = _pack_sched(sched.fwd_ranges, sched.fwd_count, sched.fwd_full)
    S = nK
    qt = jnp.swapaxes(q, 1, 2)  # [B, Hq, Tq, D]
    kt = jnp.swapaxes(k, 1, 2)
    vt = jnp.swapaxes(v, 1, 2)
    qcol = _meta_cols(meta[:3], Tq)
    krow = _meta_rows(meta[3:], Tk)

    def kv_map(b, h, i, s, sref):
        return b, lax.div(h, G), _block_at(sref, (b * nQ + i) * W, s, R), 0

    def krow_map(b, h, i, s, sref):
        return b, 0, 0, _block_at(sref, (b * nQ + i) * W, s, R)

    in_specs = [
        None if sinks is None else pl.BlockSpec(memory_space=pltpu.SMEM),
        pl.BlockSpec((None, 3, bq, LANES), lambda b, h, i, s, sref: (b, 0, i, 0)),
        pl.BlockSpec((None, 3, SUBLANES, bk), krow_map),
        pl.BlockSpec((None, None, bq, D), lambda b, h, i, s, sref: (b, h, i, 0)),
        pl.BlockSpec((None, None, bk, D), kv_map),
        pl.BlockSpec((None, None, bk, D), kv_map),
    ]
    out_specs = [
        pl.BlockSpec((None, None, bq, D), lambda b, h, i, s, sref: (b, h, i, 0)),
        pl.BlockSpec((None, None, bq, LANES), lambda b, h, i, s, sref: (b, h, i, 0)),
    ]
    out_shape = [jax.ShapeDtypeStruct((B, Hq, Tq, D), q.dtype), jax.ShapeDtypeStruct((B, Hq, Tq, LANES), jnp.float32)]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(B, Hq, nQ, S),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((bq, LANES), jnp.float32),
            pltpu.VMEM((bq, LANES), jnp.float32),
            pltpu.VMEM((bq, D), jnp.float32),
        ],
    )
    sinks_in = None if sinks is None else jnp.broadcast_to(sinks.astype(jnp.float32)[None, :], (SUBLANES, Hq))
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, nQ=nQ, R=R, W=W, S=S),
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=_interpret(cfg),
        name="peagle_attention_fwd",
        cost_estimate=attention_cost("fwd", B, Tq, Hq, Tk, Hkv, D, q.dtype.itemsize, cfg.window),
    )(packed, sinks_in, qcol, krow, qt, kt, vt)
    return jnp.swapaxes(out, 1, 2), lse[..., 0]


# ---------------------------------------------------------------------------------------
def _dq_kernel(
    sched_ref, qcol_ref, krow_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_scr, *, cfg, nQ, R, W, S
):
    b, h, i, s = (pl.program_id(a) for a in range(4))
    bk = cfg.block_k
    base = (b * nQ + i) * W
    cnt = sched_ref[base + 2 * R]

    @pl.when(s == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    j = _block_at(sched_ref, base, s, R)
    full = (j >= sched_ref[base + 2 * R + 1]) & (j < sched_ref[base + 2 * R + 2])

    def update(masked: bool):
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        lse = C.safe_lse(lse_ref[0])[:, None]  # [bq, 1]
        delta = delta_ref[0][:, None]
        sc, t = C.scores(cfg, _dot(q, k, _NT))
        if masked:
            mask = _mask_k_in_lanes(cfg, qcol_ref, krow_ref, bk)
            p = jnp.where(mask, jnp.exp(jnp.where(mask, sc, 0.0) - lse), 0.0)
        else:
            p = jnp.exp(sc - lse)
        ds = p * (_dot(do, v, _NT) - delta)
        if t is not None:
            ds = ds * (1.0 - t * t)
        dq_scr[...] += _dot(ds.astype(k.dtype), k, _NN)

    _visit(s < cnt, full, update)

    @pl.when(s == S - 1)
    def _end():
        dq_ref[...] = (dq_scr[...] * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(
    sched_ref,
    qrow_ref,
    kcol_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    dk_scr,
    dv_scr,
    *,
    cfg,
    nK,
    R,
    W,
    S,
    G,
):
    b, hk, j, g, s = (pl.program_id(a) for a in range(5))
    bq = cfg.block_q
    base = (b * nK + j) * W
    cnt = sched_ref[base + 2 * R]

    @pl.when((g == 0) & (s == 0))
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    i = _block_at(sched_ref, base, s, R)
    full = (i >= sched_ref[base + 2 * R + 1]) & (i < sched_ref[base + 2 * R + 2])

    def update(masked: bool):
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        lse = C.safe_lse(lse_ref[:1, :])  # [1, bq]
        delta = delta_ref[:1, :]
        st, t = C.scores(cfg, _dot(k, q, _NT))  # [bk, bq]
        if masked:
            mask = _mask_q_in_lanes(cfg, qrow_ref, kcol_ref, bq)
            p = jnp.where(mask, jnp.exp(jnp.where(mask, st, 0.0) - lse), 0.0)
        else:
            p = jnp.exp(st - lse)
        dv_scr[...] += _dot(p.astype(do.dtype), do, _NN)
        ds = p * (_dot(v, do, _NT) - delta)
        if t is not None:
            ds = ds * (1.0 - t * t)
        dk_scr[...] += _dot(ds.astype(q.dtype), q, _NN)

    _visit(s < cnt, full, update)

    @pl.when((g == G - 1) & (s == S - 1))
    def _end():
        dk_ref[...] = (dk_scr[...] * cfg.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_scr[...].astype(dv_ref.dtype)


def attention_bwd(cfg: C.KernelConfig, q, k, v, sinks, meta, sched, do, lse, delta):
    del sinks
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bq, bk = cfg.block_q, cfg.block_k
    nQ, nK = Tq // bq, Tk // bk
    R = sched.fwd_ranges.shape[-2]
    qt, dot_ = jnp.swapaxes(q, 1, 2), jnp.swapaxes(do, 1, 2)
    kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    interpret = _interpret(cfg)

    # ---- dQ -------------------------------------------------------------------------
    packed, W = _pack_sched(sched.fwd_ranges, sched.fwd_count, sched.fwd_full)
    S = nK

    def kv_map(b, h, i, s, sref):
        return b, lax.div(h, G), _block_at(sref, (b * nQ + i) * W, s, R), 0

    def krow_map(b, h, i, s, sref):
        return b, 0, 0, _block_at(sref, (b * nQ + i) * W, s, R)

    qblk = pl.BlockSpec((None, None, bq, D), lambda b, h, i, s, sref: (b, h, i, 0))
    stat_row = pl.BlockSpec((None, None, 1, bq), lambda b, h, i, s, sref: (b, h, 0, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, nQ=nQ, R=R, W=W, S=S),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, Hq, nQ, S),
            in_specs=[
                pl.BlockSpec((None, 3, bq, LANES), lambda b, h, i, s, sref: (b, 0, i, 0)),
                pl.BlockSpec((None, 3, SUBLANES, bk), krow_map),
                qblk,
                pl.BlockSpec((None, None, bk, D), kv_map),
                pl.BlockSpec((None, None, bk, D), kv_map),
                qblk,
                stat_row,
                stat_row,
            ],
            out_specs=qblk,
            scratch_shapes=[pltpu.VMEM((bq, D), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((B, Hq, Tq, D), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="peagle_attention_dq",
        cost_estimate=attention_cost("dq", B, Tq, Hq, Tk, Hkv, D, q.dtype.itemsize, cfg.window),
    )(
        packed,
        _meta_cols(meta[:3], Tq),
        _meta_rows(meta[3:], Tk),
        qt,
        kt,
        vt,
        dot_,
        lse[:, :, None, :],
        delta[:, :, None, :],
    )

    # ---- dK, dV -----------------------------------------------------------------------
    packed_t, W_t = _pack_sched(sched.bwd_ranges, sched.bwd_count, sched.bwd_full)
    S_t = nQ

    def q_map(b, hk, j, g, s, sref):
        return b, hk * G + g, _block_at(sref, (b * nK + j) * W_t, s, R), 0

    def qrow_map(b, hk, j, g, s, sref):
        return b, 0, 0, _block_at(sref, (b * nK + j) * W_t, s, R)

    def stat_map(b, hk, j, g, s, sref):
        return b, hk * G + g, 0, _block_at(sref, (b * nK + j) * W_t, s, R)

    kblk = pl.BlockSpec((None, None, bk, D), lambda b, hk, j, g, s, sref: (b, hk, j, 0))
    stat8 = pl.BlockSpec((None, None, SUBLANES, bq), stat_map)
    lse8 = jnp.broadcast_to(lse[:, :, None, :], (B, Hq, SUBLANES, Tq))
    delta8 = jnp.broadcast_to(delta[:, :, None, :], (B, Hq, SUBLANES, Tq))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, nK=nK, R=R, W=W_t, S=S_t, G=G),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, Hkv, nK, G, S_t),
            in_specs=[
                pl.BlockSpec((None, 3, SUBLANES, bq), qrow_map),
                pl.BlockSpec((None, 3, bk, LANES), lambda b, hk, j, g, s, sref: (b, 0, j, 0)),
                pl.BlockSpec((None, None, bq, D), q_map),
                kblk,
                kblk,
                pl.BlockSpec((None, None, bq, D), q_map),
                stat8,
                stat8,
            ],
            out_specs=[kblk, kblk],
            scratch_shapes=[pltpu.VMEM((bk, D), jnp.float32), pltpu.VMEM((bk, D), jnp.float32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((B, Hkv, Tk, D), jnp.float32)] * 2,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")
        ),
        interpret=interpret,
        name="peagle_attention_dkv",
        cost_estimate=attention_cost("dkv", B, Tq, Hq, Tk, Hkv, D, q.dtype.itemsize, cfg.window),
    )(packed_t, _meta_rows(meta[:3], Tq), _meta_cols(meta[3:], Tk), qt, kt, vt, dot_, lse8, delta8)
    return jnp.swapaxes(dq, 1, 2), jnp.swapaxes(dk, 1, 2), jnp.swapaxes(dv, 1, 2)


op = C.make_op(attention_fwd, attention_bwd)
