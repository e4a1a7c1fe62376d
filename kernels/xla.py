"""Blockwise attention in pure JAX (runs on every platform; the CPU default).

Flash-attention style: an outer loop over (batch, query block) and an inner
``fori_loop`` with a *dynamic* trip count over the KV blocks of that query block's
schedule, so empty blocks cost nothing and full blocks skip the mask arithmetic (a
``lax.cond``). Memory is O(T * block): q/k/v/out, O(T) softmax statistics and one
[Hq, block_q, block_k] score tile at a time; the [T, T] mask never exists.

Backward: one pass over the transposed schedule (for each KV block, the query blocks that
see it): dK/dV accumulate per KV block, dQ is added into the query block's rows. GQA: the G query heads of a
KV head are processed together against one K/V tile.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import _common as C
from .schedule import flat_ids

__all__ = ["attention_fwd", "attention_bwd", "op"]


def _dot(a, b, spec):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _slice_rows(x, b, start, size):
    """x [B, T, ...] -> x[b, start:start+size]."""
    idx = (b, start) + (0,) * (x.ndim - 2)
    return lax.dynamic_slice(x, idx, (1, size) + x.shape[2:])[0]


def _slice_meta(meta3, b, start, size):
    return tuple(lax.dynamic_slice(m, (b, start), (1, size))[0] for m in meta3)


def attention_fwd(cfg: C.KernelConfig, q, k, v, sinks, meta, sched):
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bq, bk = cfg.block_q, cfg.block_k
    nQ, nK = Tq // bq, Tk // bk
    qmeta, kmeta = meta[:3], meta[3:]
    ids = flat_ids(sched.fwd_ranges, sched.fwd_count, nK)  # [B, nQ, nK]
    qr = q.reshape(B, Tq, Hkv, G, D)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(Hkv, G, 1)

    def q_block(t, carry):
        out, lse = carry
        b, i = t // nQ, t % nQ
        qb = _slice_rows(qr, b, i * bq, bq)  # [bq, Hkv, G, D]
        qa, qd, qc = (x[:, None] for x in _slice_meta(qmeta, b, i * bq, bq))
        fs, fe = sched.fwd_full[b, i, 0], sched.fwd_full[b, i, 1]

        def step(s, st):
            j = ids[b, i, s]
            kb = _slice_rows(k, b, j * bk, bk)  # [bk, Hkv, D]
            vb = _slice_rows(v, b, j * bk, bk)
            sc, _ = C.scores(cfg, _dot(qb, kb, "qhgd,khd->hgqk"))  # [Hkv, G, bq, bk]

            def pv(p):
                return _dot(p.astype(vb.dtype), vb, "hgqk,khd->hgqd")

            def full_branch(st):
                return C.online_update(*st, sc, None, pv)

            def mask_branch(st):
                ka, kd, kc = (x[None, :] for x in _slice_meta(kmeta, b, j * bk, bk))
                mask = C.block_mask(cfg, qa, qd, qc, ka, kd, kc)
                return C.online_update(*st, sc, mask, pv)

            return lax.cond((j >= fs) & (j < fe), full_branch, mask_branch, st)

        init = (
            jnp.full((Hkv, G, bq), C.NEG_INF, jnp.float32),
            jnp.zeros((Hkv, G, bq), jnp.float32),
            jnp.zeros((Hkv, G, bq, D), jnp.float32),
        )
        m, l, acc = lax.fori_loop(0, sched.fwd_count[b, i], step, init)
        o, ls = C.finalize(m, l, acc, sink)
        o = jnp.transpose(o, (2, 0, 1, 3)).reshape(1, bq, Hq, D).astype(out.dtype)
        out = lax.dynamic_update_slice(out, o, (b, i * bq, 0, 0))
        lse = lax.dynamic_update_slice(lse, ls.reshape(1, Hq, bq), (b, 0, i * bq))
        return out, lse

    out = jnp.zeros((B, Tq, Hq, D), q.dtype)
    lse = jnp.zeros((B, Hq, Tq), jnp.float32)
    return lax.fori_loop(0, B * nQ, q_block, (out, lse))


def attention_bwd(cfg: C.KernelConfig, q, k, v, sinks, meta, sched, do, lse, delta):
    del sinks  # enters only through lse (and dsinks, computed by the caller)
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bq, bk = cfg.block_q, cfg.block_k
    nQ, nK = Tq // bq, Tk // bk
    qmeta, kmeta = meta[:3], meta[3:]
    qr = q.reshape(B, Tq, Hkv, G, D)
    dor = do.reshape(B, Tq, Hkv, G, D)
    lser = C.safe_lse(lse).reshape(B, Hkv, G, Tq)
    deltar = delta.reshape(B, Hkv, G, Tq)

    def q_side(b, i):
        qb = _slice_rows(qr, b, i * bq, bq)
        dob = _slice_rows(dor, b, i * bq, bq)
        lb = lax.dynamic_slice(lser, (b, 0, 0, i * bq), (1, Hkv, G, bq))[0]
        db = lax.dynamic_slice(deltar, (b, 0, 0, i * bq), (1, Hkv, G, bq))[0]
        qm = tuple(x[:, None] for x in _slice_meta(qmeta, b, i * bq, bq))
        return qb, dob, lb, db, qm

    def k_side(b, j):
        kb = _slice_rows(k, b, j * bk, bk)
        vb = _slice_rows(v, b, j * bk, bk)
        km = tuple(x[None, :] for x in _slice_meta(kmeta, b, j * bk, bk))
        return kb, vb, km

    def tile(qb, dob, lb, db, qm, kb, vb, km, full):
        """(p, ds) for one tile, [Hkv, G, bq, bk] f32."""
        sc, t = C.scores(cfg, _dot(qb, kb, "qhgd,khd->hgqk"))
        mask = None if full else C.block_mask(cfg, *qm, *km)
        p = C.probs(sc, lb, mask)
        dp = _dot(dob, vb, "qhgd,khd->hgqk")
        return p, C.dscores(cfg, p, dp, db, t)

    # ---- one pass: for each KV block, the query blocks that see it. dK/dV accumulate in the
    # inner loop's carry; dQ is added into the query block's rows of the whole dQ array (an
    # in-place update of the loop carry), so each tile's scores and probabilities are computed
    # once, not once for dQ and again for dK/dV.
    ids_t = flat_ids(sched.bwd_ranges, sched.bwd_count, nQ)

    def dkv_block(t, carry):
        dq, dk, dv = carry
        b, j = t // nK, t % nK
        kb, vb, km = k_side(b, j)
        fs, fe = sched.bwd_full[b, j, 0], sched.bwd_full[b, j, 1]

        def step(s, acc):
            dq, dka, dva = acc
            i = ids_t[b, j, s]
            qs = q_side(b, i)
            qb, dob = qs[0], qs[1]

            def branch(full):
                def f(dka, dva):
                    p, ds = tile(*qs, kb, vb, km, full)
                    dva = dva + _dot(p.astype(dob.dtype), dob, "hgqk,qhgd->khd")
                    dka = dka + _dot(ds.astype(qb.dtype), qb, "hgqk,qhgd->khd")
                    return dka, dva, _dot(ds.astype(kb.dtype), kb, "hgqk,khd->qhgd")

                return f

            # dQ stays out of the cond: a conditional copies the arrays it returns
            dka, dva, dqb = lax.cond((i >= fs) & (i < fe), branch(True), branch(False), dka, dva)
            start = (b, i * bq, 0, 0)
            dqb = dqb.reshape(1, bq, Hq, D)
            return lax.dynamic_update_slice(dq, lax.dynamic_slice(dq, start, dqb.shape) + dqb, start), dka, dva

        z = jnp.zeros((bk, Hkv, D), jnp.float32)
        dq, dka, dva = lax.fori_loop(0, sched.bwd_count[b, j], step, (dq, z, z))
        dk = lax.dynamic_update_slice(dk, (dka * cfg.scale)[None], (b, j * bk, 0, 0))
        dv = lax.dynamic_update_slice(dv, dva[None], (b, j * bk, 0, 0))
        return dq, dk, dv

    z = jnp.zeros((B, Tk, Hkv, D), jnp.float32)
    dq, dk, dv = lax.fori_loop(0, B * nK, dkv_block, (jnp.zeros((B, Tq, Hq, D), jnp.float32), z, z))
    return dq * cfg.scale, dk, dv


op = C.make_op(attention_fwd, attention_bwd)
