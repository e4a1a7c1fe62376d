"""Pallas GPU kernels (Triton lowering: Ampere, Hopper) for block-sparse attention.

Layout [B, T, H, D] as given (no transposes). Forward grid (query block, batch, query
head): the program keeps its q tile in registers and walks the KV blocks of its schedule
with a dynamic-bound loop (``ids`` / ``info`` read from global memory), so empty blocks are
never touched; full blocks skip the mask arithmetic (``lax.cond``). Backward: a dQ kernel
of the same shape and a dK/dV kernel with grid (KV block, batch, KV head) that walks the
transposed schedule and, for each query block, the G query heads of its group (GQA
gradients are summed in the kernel, no [.., Hq, ..] temporaries).

Triton needs power-of-two tile shapes >= 16: block sizes are powers of two, sequences are
padded to block multiples by the caller, head_dim is zero-padded to a power of two here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import _common as C
from . import limits
from .cost import attention_cost
from .schedule import flat_ids

__all__ = ["op", "fit_blocks", "smem_bytes", "attention_fwd", "attention_bwd"]

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b
_NN = (((1,), (0,)), ((), ()))  # a @ b


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def smem_bytes(block_q: int, block_k: int, head_dim: int, itemsize: int) -> int:
    """Shared memory Triton asks for the largest of the three kernels (the backward's): per query
    row three f32 staging tiles and the q / dO tiles, per key row the k / v tiles. Fitted to the
    CUDA compiler's requests at head dims 64-256 in bf16 and f32 (it over-estimates a little:
    what it admits compiles; tests/compile/ checks each family's head shape)."""
    return head_dim * (block_q * (12 + 2 * itemsize) + block_k * 2 * itemsize)


def fit_blocks(block_q: int, block_k: int, Tq: int, Tk: int, head_dim: int = 64, itemsize: int = 2):
    """Power-of-two blocks >= 16, no larger than needed for short sequences, halved (block_q
    first) until `smem_bytes` fits the traced-for GPU's shared memory (`kernels.limits`).
    None when even 16 x 16 tiles do not fit (the caller takes another path)."""
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"gpu backend: {name}={b} must be a power of two >= 16")
    bq, bk = min(block_q, max(16, _next_pow2(Tq))), min(block_k, max(16, _next_pow2(Tk)))
    D, limit = max(16, _next_pow2(head_dim)), limits.current("gpu").smem_per_block
    while smem_bytes(bq, bk, D, itemsize) > limit:
        if bq == bk == 16:
            return None
        if bq > 16:
            bq //= 2
        else:
            bk //= 2
    return bq, bk


def _dot(a, b, dims):
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _params(D, interpret):
    if interpret:
        return None
    return plgpu.CompilerParams(num_warps=4 if D <= 64 else 8, num_stages=2)


def _pad_d(x, Dp):
    D = x.shape[-1]
    return x if D == Dp else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, Dp - D)])


def _sched_arrays(ranges, count, full, steps):
    ids = flat_ids(ranges, count, steps)  # [B, n, steps]
    info = jnp.stack([count, full[..., 0], full[..., 1], jnp.zeros_like(count)], axis=-1)
    return ids, info.astype(jnp.int32)  # [B, n, 4]


# ---------------------------------------------------------------------------------------
def _fwd_kernel(
    ids_ref,
    info_ref,
    qa_ref,
    qd_ref,
    qc_ref,
    ka_ref,
    kd_ref,
    kc_ref,
    sink_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    lse_ref,
    *,
    cfg: C.KernelConfig,
):
    bq, bk = cfg.block_q, cfg.block_k
    D = q_ref.shape[-1]
    q = q_ref[...]
    qm = (qa_ref[...][:, None], qd_ref[...][:, None], qc_ref[...][:, None])
    count, fs, fe = info_ref[0], info_ref[1], info_ref[2]

    def body(s, carry):
        j = ids_ref[s]
        sl = pl.ds(pl.multiple_of(j * bk, bk), bk)
        k = k_ref[sl, :]
        v = v_ref[sl, :]
        sc, _ = C.scores(cfg, _dot(q, k, _NT))

        def pv(p):
            return _dot(p.astype(v.dtype), v, _NN)

        def full_fn(c):
            return C.online_update(*c, sc, None, pv)

        def mask_fn(c):
            km = (ka_ref[sl][None, :], kd_ref[sl][None, :], kc_ref[sl][None, :])
            return C.online_update(*c, sc, C.block_mask(cfg, *qm, *km), pv)

        return lax.cond((j >= fs) & (j < fe), full_fn, mask_fn, carry)

    init = (jnp.full((bq,), C.NEG_INF, jnp.float32), jnp.zeros((bq,), jnp.float32), jnp.zeros((bq, D), jnp.float32))
    m, l, acc = lax.fori_loop(0, count, body, init)
    sink = None if sink_ref is None else sink_ref[0]
    o, lse = C.finalize(m, l, acc, sink)
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse


def attention_fwd(cfg: C.KernelConfig, q, k, v, sinks, meta, sched):
    B, Tq, Hq, D0 = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bq, bk = cfg.block_q, cfg.block_k
    nQ, nK = Tq // bq, Tk // bk
    D = max(16, _next_pow2(D0))
    q, k, v = (_pad_d(x, D) for x in (q, k, v))
    ids, info = _sched_arrays(sched.fwd_ranges, sched.fwd_count, sched.fwd_full, nK)

    qmeta_spec = pl.BlockSpec((None, bq), lambda i, b, h: (b, i))
    kmeta_spec = pl.BlockSpec((None, Tk), lambda i, b, h: (b, 0))
    in_specs = [
        pl.BlockSpec((None, None, nK), lambda i, b, h: (b, i, 0)),
        pl.BlockSpec((None, None, 4), lambda i, b, h: (b, i, 0)),
        qmeta_spec,
        qmeta_spec,
        qmeta_spec,
        kmeta_spec,
        kmeta_spec,
        kmeta_spec,
        None if sinks is None else pl.BlockSpec((1,), lambda i, b, h: (h,)),
        pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, Tk, None, D), lambda i, b, h: (b, 0, lax.div(h, G), 0)),
        pl.BlockSpec((None, Tk, None, D), lambda i, b, h: (b, 0, lax.div(h, G), 0)),
    ]
    out_specs = [
        pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
    ]
    out_shape = [jax.ShapeDtypeStruct((B, Tq, Hq, D), q.dtype), jax.ShapeDtypeStruct((B, Hq, Tq), jnp.float32)]
    sinks_in = None if sinks is None else sinks.astype(jnp.float32)
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg),
        grid=(nQ, B, Hq),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(D, cfg.interpret),
        interpret=cfg.interpret,
        name="peagle_attention_fwd",
        cost_estimate=attention_cost("fwd", B, Tq, Hq, Tk, Hkv, D, q.dtype.itemsize, cfg.window),
    )(ids, info, *meta, sinks_in, q, k, v)
    return out[..., :D0], lse


# ---------------------------------------------------------------------------------------
def _dq_kernel(
    ids_ref,
    info_ref,
    qa_ref,
    qd_ref,
    qc_ref,
    ka_ref,
    kd_ref,
    kc_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dq_ref,
    *,
    cfg: C.KernelConfig,
):
    bk = cfg.block_k
    q = q_ref[...]
    do = do_ref[...]
    lse = C.safe_lse(lse_ref[...])
    delta = delta_ref[...]
    qm = (qa_ref[...][:, None], qd_ref[...][:, None], qc_ref[...][:, None])
    count, fs, fe = info_ref[0], info_ref[1], info_ref[2]

    def body(s, acc):
        j = ids_ref[s]
        sl = pl.ds(pl.multiple_of(j * bk, bk), bk)
        k = k_ref[sl, :]
        v = v_ref[sl, :]
        sc, t = C.scores(cfg, _dot(q, k, _NT))
        dp = _dot(do, v, _NT)

        def step(mask):
            p = C.probs(sc, lse, mask)
            ds = C.dscores(cfg, p, dp, delta, t)
            return _dot(ds.astype(k.dtype), k, _NN)

        def full_fn(acc):
            return acc + step(None)

        def mask_fn(acc):
            km = (ka_ref[sl][None, :], kd_ref[sl][None, :], kc_ref[sl][None, :])
            return acc + step(C.block_mask(cfg, *qm, *km))

        return lax.cond((j >= fs) & (j < fe), full_fn, mask_fn, acc)

    acc = lax.fori_loop(0, count, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (acc * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(
    ids_ref,
    info_ref,
    qa_ref,
    qd_ref,
    qc_ref,
    ka_ref,
    kd_ref,
    kc_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    dk_ref,
    dv_ref,
    *,
    cfg: C.KernelConfig,
    G: int,
):
    bq = cfg.block_q
    k = k_ref[...]
    v = v_ref[...]
    km = (ka_ref[...][None, :], kd_ref[...][None, :], kc_ref[...][None, :])
    count, fs, fe = info_ref[0], info_ref[1], info_ref[2]

    def body(s, carry):
        i = ids_ref[s]
        sl = pl.ds(pl.multiple_of(i * bq, bq), bq)
        full = (i >= fs) & (i < fe)

        def head(g, carry):
            dk, dv = carry
            q = q_ref[sl, g, :]
            do = do_ref[sl, g, :]
            lse = C.safe_lse(lse_ref[g, sl])
            delta = delta_ref[g, sl]
            sc, t = C.scores(cfg, _dot(q, k, _NT))
            dp = _dot(do, v, _NT)

            def step(mask):
                p = C.probs(sc, lse, mask)
                ds = C.dscores(cfg, p, dp, delta, t)
                return (dk + _dot(ds.astype(q.dtype), q, _TN), dv + _dot(p.astype(do.dtype), do, _TN))

            def full_fn(_):
                return step(None)

            def mask_fn(_):
                qm = (qa_ref[sl][:, None], qd_ref[sl][:, None], qc_ref[sl][:, None])
                return step(C.block_mask(cfg, *qm, *km))

            return lax.cond(full, full_fn, mask_fn, 0)

        return lax.fori_loop(0, G, head, carry)

    z = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, count, body, (z, z))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def attention_bwd(cfg: C.KernelConfig, q, k, v, sinks, meta, sched, do, lse, delta):
    del sinks
    B, Tq, Hq, D0 = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bq, bk = cfg.block_q, cfg.block_k
    nQ, nK = Tq // bq, Tk // bk
    D = max(16, _next_pow2(D0))
    q, k, v, do = (_pad_d(x, D) for x in (q, k, v, do))
    params = _params(D, cfg.interpret)

    # dQ: grid (query block, batch, query head)
    ids, info = _sched_arrays(sched.fwd_ranges, sched.fwd_count, sched.fwd_full, nK)
    qmeta_spec = pl.BlockSpec((None, bq), lambda i, b, h: (b, i))
    kmeta_spec = pl.BlockSpec((None, Tk), lambda i, b, h: (b, 0))
    qrow = pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0))
    kfull = pl.BlockSpec((None, Tk, None, D), lambda i, b, h: (b, 0, lax.div(h, G), 0))
    stat = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(nQ, B, Hq),
        in_specs=[
            pl.BlockSpec((None, None, nK), lambda i, b, h: (b, i, 0)),
            pl.BlockSpec((None, None, 4), lambda i, b, h: (b, i, 0)),
            qmeta_spec,
            qmeta_spec,
            qmeta_spec,
            kmeta_spec,
            kmeta_spec,
            kmeta_spec,
            qrow,
            kfull,
            kfull,
            qrow,
            stat,
            stat,
        ],
        out_specs=qrow,
        out_shape=jax.ShapeDtypeStruct((B, Tq, Hq, D), jnp.float32),
        compiler_params=params,
        interpret=cfg.interpret,
        name="peagle_attention_dq",
        cost_estimate=attention_cost("dq", B, Tq, Hq, Tk, Hkv, D, q.dtype.itemsize, cfg.window),
    )(ids, info, *meta, q, k, v, do, lse, delta)

    # dK, dV: grid (KV block, batch, KV head); G query heads per program
    ids_t, info_t = _sched_arrays(sched.bwd_ranges, sched.bwd_count, sched.bwd_full, nQ)
    qmeta_full = pl.BlockSpec((None, Tq), lambda j, b, h: (b, 0))
    kmeta_blk = pl.BlockSpec((None, bk), lambda j, b, h: (b, j))
    qgroup = pl.BlockSpec((None, Tq, G, D), lambda j, b, h: (b, 0, h, 0))
    kblk = pl.BlockSpec((None, bk, None, D), lambda j, b, h: (b, j, h, 0))
    stat_g = pl.BlockSpec((None, G, Tq), lambda j, b, h: (b, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, G=G),
        grid=(nK, B, Hkv),
        in_specs=[
            pl.BlockSpec((None, None, nQ), lambda j, b, h: (b, j, 0)),
            pl.BlockSpec((None, None, 4), lambda j, b, h: (b, j, 0)),
            qmeta_full,
            qmeta_full,
            qmeta_full,
            kmeta_blk,
            kmeta_blk,
            kmeta_blk,
            qgroup,
            kblk,
            kblk,
            qgroup,
            stat_g,
            stat_g,
        ],
        out_specs=[kblk, kblk],
        out_shape=[jax.ShapeDtypeStruct((B, Tk, Hkv, D), jnp.float32)] * 2,
        compiler_params=params,
        interpret=cfg.interpret,
        name="peagle_attention_dkv",
        cost_estimate=attention_cost("dkv", B, Tq, Hq, Tk, Hkv, D, q.dtype.itemsize, cfg.window),
    )(ids_t, info_t, *meta, q, k, v, do, lse, delta)
    return dq[..., :D0], dk[..., :D0], dv[..., :D0]


op = C.make_op(attention_fwd, attention_bwd)
