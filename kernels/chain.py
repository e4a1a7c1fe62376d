"""The chain keys of a P-EAGLE query, gathered outside the block loop (`AttentionSpec.chain_depth`).

A COD row (anchor a, depth d) sees two kinds of keys: the depth-0 rows of its context (a causal
prefix: the blockwise kernels' dense blocks) and its own chain, the rows (a, 1..d): at most one
key per depth, scattered over one block per depth in a (depth, anchor)-sorted layout. Visiting
those blocks for one visible key per row costs the block loop as much as the whole context at
short lengths (2.1x the blocks at 512 tokens, 1.5x at 2048, K 8). With ``chain_depth`` W, the
keys of depth 1..W are instead looked up per query (W small gathers) and attended densely, the
block loop sees them as padding (so it skips their blocks), and the two softmax parts are
merged through their log-sum-exps. The result is the same attention for any W; keys deeper than
W, and keys whose (anchor, depth) is not unique in their batch row (possible only with
per-document positions), stay in the block loop.

Without its chain keys a query sees in the block loop only the depth-0 keys of its context, a
causal prefix that depends on its (doc, anchor) alone, so the loop runs on the queries sorted by
(doc, anchor, depth) (`sort_queries`): a block of a (depth, anchor)-sorted layout spans one depth
and ~block / retention anchors (640 at r_min 0.2 and 128 rows), a sorted block ~block / rows per
anchor (~40), and the causal edge cuts fewer of its tiles.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import dense
from ._common import zero_cotangent
from .spec import AttentionSpec

__all__ = ["split", "sort_queries", "permute_rows", "attention", "merge"]

_NONE = jnp.iinfo(jnp.int32).max


def _code(anchor, depth, width: int):
    """A unique int per (anchor, depth in 1..width), or None where it cannot be formed."""
    ok = (anchor >= 0) & (anchor < (_NONE - width) // (width + 1) - 1)
    return anchor * (width + 1) + depth, ok


def split(spec: AttentionSpec):
    """(the spec of the block loop: gathered keys marked padding, idx [B, Tq, W] key rows of
    each query's chain, found [B, Tq, W] bool)."""
    width = spec.chain_depth
    qa, qd, qc = spec.q_meta
    ka, kd, kc = spec.kv_meta
    code, ok = _code(ka, kd, width)
    code = jnp.where(ok & (kc >= 0) & (kd >= 1) & (kd <= width), code, _NONE)
    order = jnp.argsort(code, axis=-1, stable=True)
    code_s = jnp.take_along_axis(code, order, axis=-1)
    same_next = code_s[:, 1:] == code_s[:, :-1]
    pad = jnp.zeros_like(same_next[:, :1])
    unique_s = (code_s != _NONE) & ~jnp.concatenate([same_next, pad], 1) & ~jnp.concatenate([pad, same_next], 1)
    rows = jnp.arange(code.shape[0])[:, None]
    gathered = jnp.zeros(code.shape, bool).at[rows, order].set(unique_s)

    w = jnp.arange(1, width + 1, dtype=jnp.int32)
    target, q_ok = _code(qa[..., None], w, width)  # [B, Tq, W]
    pos = jax.vmap(lambda c, t: jnp.searchsorted(c, t.reshape(-1)).reshape(t.shape))(code_s, target)
    pos = jnp.minimum(pos, code.shape[1] - 1).reshape(pos.shape[0], -1)

    def at(x, i):  # x [B, Tk] read at i [B, Tq * W] -> [B, Tq, W]
        return jnp.take_along_axis(x, i, axis=-1).reshape(target.shape)

    idx = at(order, pos)
    found = at(code_s, pos) == target
    found &= at(unique_s, pos) & q_ok & (w <= qd[..., None]) & (qc[..., None] >= 0)
    found &= at(kc, idx.reshape(pos.shape)) == qc[..., None]
    return dataclasses.replace(spec, kv_doc=jnp.where(gathered, -1, kc), chain_depth=0), idx, found


def sort_queries(spec: AttentionSpec):
    """(spec with its queries sorted by (doc, anchor, depth), padding rows last; order, inverse
    [B, Tq] int32): sorted row i is row order[i], row j is sorted row inverse[j]."""
    qa, qd, qc = spec.q_meta
    order = jnp.lexsort((qd, qa, jnp.where(qc >= 0, qc, _NONE)), axis=-1).astype(jnp.int32)
    inverse = jnp.argsort(order, axis=-1).astype(jnp.int32)
    qa, qd, qc = (jnp.take_along_axis(x, order, axis=-1) for x in spec.q_meta)
    return dataclasses.replace(spec, q_anchor=qa, q_depth=qd, q_doc=qc), order, inverse


@jax.custom_vjp
def permute_rows(x, order, inverse):
    """x [B, T, ...] -> x[b, order[b]]; its gradient the gather by ``inverse`` (autodiff would
    scatter-add, which XLA's CPU backend runs as a serial loop)."""
    return jax.vmap(lambda xb, ob: xb[ob])(x, order)


def _permute_fwd(x, order, inverse):
    return permute_rows(x, order, inverse), (order, inverse)


def _permute_bwd(res, ct):
    order, inverse = res
    return permute_rows(ct, inverse, order), zero_cotangent(order), zero_cotangent(inverse)


permute_rows.defvjp(_permute_fwd, _permute_bwd)


def attention(q, k, v, idx, found, *, scale: float, softcap: float | None):
    """Each query over its gathered keys: `kernels.dense` with one query per batch row and its
    W keys: (out [B, Tq, Hq, D], lse [B, Hq, Tq] f32; no key: out 0, lse -inf)."""
    b, tq, hq, d = q.shape
    hkv, width = k.shape[2], idx.shape[-1]
    flat = idx.reshape(b, -1)[:, :, None, None]
    kc, vc = (jnp.take_along_axis(x, flat, axis=1).reshape(b * tq, width, hkv, d) for x in (k, v))
    out, lse = dense.attention(
        q.reshape(b * tq, 1, hq, d), kc, vc, found.reshape(b * tq, 1, width), scale=scale, softcap=softcap
    )
    return out.reshape(b, tq, hq, d), jnp.moveaxis(lse.reshape(b, tq, hq), 1, 2)


def merge(out1, lse1, out2, lse2):
    """Attention over two disjoint key sets from each one's (out [B, Tq, Hq, D], lse [B, Hq, Tq])."""
    m = jax.lax.stop_gradient(jnp.maximum(lse1, lse2))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e1, e2 = jnp.exp(lse1 - m), jnp.exp(lse2 - m)  # -inf -> 0
    tot = e1 + e2
    safe = jnp.where(tot > 0, tot, 1.0)
    w1, w2 = (jnp.moveaxis(e / safe, 1, 2) for e in (e1, e2))
    # as einsums: their gradients with respect to the weights then are einsums too (`_common.rowdot`)
    out = jnp.einsum("bthd,bth->bthd", out1.astype(jnp.float32), w1) + jnp.einsum("bthd,bth->bthd", out2, w2)
    return out, jnp.where(tot > 0, m + jnp.log(safe), -jnp.inf)
