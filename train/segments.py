"""Exact sequence partitioning (reference/peagle.md section 5): one step over S segments.

Segment of a row: seg = ((anchor if depth == 0 else anchor + 1) * S) // L, clamped to
[0, S - 1], L = the row-space length of the batch. Segment s runs forward + backward over

- the context: the depth-0 rows (rows [0, L) of a batch are the depth-0 rows of anchors
  0..L-1), those past the segment's last owned anchor made padding (doc -1: they are never
  attended to by its rows, and padding blocks cost no attention);
- its own deeper rows (depth >= 1), packed on the host into R slots per segment
  (`segment_rows`, the batch key "seg_rows" [B, S, R]);

and takes its loss over its own rows only: the depth-0 rows with seg == s (a contiguous anchor
range, one static-size slice) plus its deeper rows, divided by the WHOLE batch's counts. The
segment losses therefore sum to the flat loss and their gradients to the flat gradient. A
`lax.scan` accumulates the gradients inside the jitted step, so one segment's activations and
its [rows / S, Vd] logits and teacher are alive at a time (the teacher is computed per row from
the target's final-norm states, never as the flat pass's [L, Vd] table). The price is compute:
every segment recomputes its context rows (the layers, not the [rows, Vd] head).

Chain mode (EAGLE-3 training-time test) uses the same segments: the context is step 0, the
segment's rows of steps 1..k-1 are packed step by step into W slots each (the same anchors at
every step), so step j's hidden input is the previous step's pre-norm state of the same slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import kernels
from train.loss import forward_kl, next_rows, take_rows, teacher_logits

__all__ = ["segment_bounds", "row_segments", "resolve_segments", "segment_rows", "segmented_loss"]

EPS = 1e-5  # train.loss.draft_loss's denominator epsilon (speculators 0.9.0)


def segment_bounds(length: int, segments: int) -> np.ndarray:
    """[S + 1]: segment s owns the depth-0 rows of anchors [b[s], b[s + 1]) (b[s] = ceil(s L / S))."""
    return np.array([-(-s * length // segments) for s in range(segments + 1)], np.int32)


def row_segments(anchor: np.ndarray, depth: np.ndarray, length: int, segments: int) -> np.ndarray:
    """The segment of each row (peagle.md section 5)."""
    key = np.where(depth == 0, anchor, anchor + 1).astype(np.int64)
    return np.clip(key * segments // length, 0, segments - 1)


def resolve_segments(segments: int | str, rows: int, max_rows: int) -> int:
    """S of a batch of `rows` COD rows per sequence: the int given, or ceil(rows / max_rows) for "auto"."""
    if str(segments) == "auto":
        return max(1, -(-rows // max_rows))
    try:
        s = int(segments)
    except (TypeError, ValueError):
        s = 0
    if s < 1 or isinstance(segments, bool):
        raise ValueError(f"loop.segments must be an integer >= 1 or auto, got {segments!r}")
    return s


def _round_up(n: int) -> int:
    step = 8 if n <= 512 else 128  # few distinct shapes (each compiles once), little padding
    return max(step, -(-n // step) * step)


def segment_rows(anchor, depth, doc, length: int, segments: int, mode: str, k: int) -> np.ndarray:
    """int32 [B, S, R]: for each segment, the batch indices of its own rows of depth >= 1 in
    (depth, anchor) order, padded with N (= no row). Chain mode: step j's rows at slots
    [(j - 1) W, j W), slot i = anchor lo_s + i at every step (R = (k - 1) W)."""
    anchor, depth, doc = (np.asarray(x) for x in (anchor, depth, doc))
    b, n = anchor.shape
    if n < length or not (depth[:, :length] == 0).all() or not (anchor[:, :length] == np.arange(length)).all():
        raise ValueError(
            "sequence partitioning needs rows [0, L) to be the depth-0 rows of anchors 0..L-1 "
            "(the layout of train.cod.make_batch)"
        )
    seg = row_segments(anchor, depth, length, segments)
    if mode == "chain":
        if n != k * length or not (depth == np.repeat(np.arange(k), length)).all():
            raise ValueError("chain-mode partitioning needs the k x L rows of train.cod.chain_rows")
        seg_a = row_segments(np.arange(length), np.ones(length, np.int64), length, segments)
        width = max(1, int(np.bincount(seg_a, minlength=segments).max()))
        out = np.full((b, segments, (k - 1) * width), n, np.int32)
        for s in range(segments):
            anchors = np.nonzero(seg_a == s)[0]
            for j in range(1, k):
                out[:, s, (j - 1) * width : (j - 1) * width + len(anchors)] = j * length + anchors
        return out
    own = [
        [np.nonzero((seg[i] == s) & (doc[i] >= 0) & (np.arange(n) >= length))[0] for s in range(segments)]
        for i in range(b)
    ]
    rows = _round_up(max(len(x) for per in own for x in per))
    out = np.full((b, segments, rows), n, np.int32)
    for i in range(b):
        for s in range(segments):
            out[i, s, : len(own[i][s])] = own[i][s]
    return out


def segmented_loss(
    parts,
    params,
    frozen,
    aux,
    y,
    head_w,
    batch,
    *,
    mode: str,
    k: int,
    per_depth: bool,
    chain_decay: float,
    softcap,
    attention: str = "kernels",
    with_grads: bool = True,
):
    """(loss, metrics, grads) of one batch over the segments of batch["seg_rows"]: the same
    values as `train.step.loss_and_metrics` (and its gradient) computed in one flat pass;
    grads is None without `with_grads` (evaluation)."""
    anchor, depth, doc = batch["anchor"], batch["depth"], batch["doc"]
    bsz, n = anchor.shape
    length = aux.shape[1]
    seg_rows = jnp.moveaxis(jnp.asarray(batch["seg_rows"], jnp.int32), 1, 0)  # [S, B, R]
    nseg, _, r = seg_rows.shape
    bounds = jnp.asarray(segment_bounds(length, nseg))
    c0 = -(-length // nseg)  # depth-0 rows a segment owns, at most
    if attention == "auto":  # as the flat pass: a dense mask below a few thousand rows
        attention = "dense" if length + r <= 4096 else "kernels"
    backend = "auto" if attention == "kernels" else "dense"

    tokens = batch["tokens"]
    row_tok = next_rows(tokens)  # row t: x[t + 1]
    y_next = next_rows(y)  # row t's teacher: the target at t + 1
    ref_all = jnp.clip(anchor + depth, 0, length - 1)
    sup = take_rows(batch["sup"], ref_all) & (doc >= 0)
    # whole-batch counts: every segment divides by these, so the segments sum to the flat loss
    counts = jnp.sum(jax.nn.one_hot(depth, k, dtype=jnp.float32) * sup[..., None], axis=(0, 1))  # [k]
    rows_total = jnp.sum(sup.astype(jnp.float32))
    present = (counts > 0).astype(jnp.float32)
    depth_weight = present / jnp.maximum(counts, 1.0) / jnp.maximum(jnp.sum(present), 1.0)

    ctx_a, ctx_d, ctx_c = anchor[:, :length], depth[:, :length], doc[:, :length]

    def rows_of(s, idx):
        """Metadata of the segment's forward rows: context (L) then its deeper rows (R)."""
        hi = bounds[s + 1]
        valid = idx < n
        ii = jnp.minimum(idx, n - 1)
        a = jnp.concatenate([ctx_a, take_rows(anchor, ii)], axis=1)
        d = jnp.concatenate([ctx_d, take_rows(depth, ii)], axis=1)
        c = jnp.concatenate([jnp.where(ctx_a < hi, ctx_c, -1), jnp.where(valid, take_rows(doc, ii), -1)], axis=1)
        # the depth-0 rows it owns: one static-size slice, rows outside [lo, hi) masked
        start = jnp.minimum(bounds[s], length - c0)
        own0 = start + jnp.arange(c0)
        owned0 = (own0 >= bounds[s]) & (own0 < hi)
        return a, d, c, valid, own0, owned0

    def row_loss(model, pre, la, ld, lc, owned):
        """KL and hits of loss rows from their pre-norm states (teacher per row, at ref)."""
        logits = model.head(pre)
        ref = jnp.clip(la + ld, 0, length - 1)
        zeros = jnp.zeros((head_w.shape[0],), jnp.int32)
        teacher = jax.nn.log_softmax(teacher_logits(take_rows(y_next, ref), head_w, zeros, softcap=softcap), axis=-1)
        mask = (take_rows(batch["sup"], ref) & (lc >= 0) & owned).astype(jnp.float32)
        kl = forward_kl(logits, teacher) * mask
        hit = jnp.argmax(logits, -1) == jnp.argmax(teacher, -1)
        return kl, hit, mask

    def parallel(model, s, idx):
        a, d, c, valid, own0, owned0 = rows_of(s, idx)
        mask_hidden = model.mask_hidden[...]
        aux_rows = jnp.concatenate(
            [aux.astype(mask_hidden.dtype), jnp.broadcast_to(mask_hidden, (bsz, r, mask_hidden.shape[-1]))], axis=1
        )
        tok = jnp.concatenate([row_tok, jnp.full((bsz, r), model.config.mask_token_id, row_tok.dtype)], axis=1)
        positions = jnp.where(c >= 0, a + d, -1)
        spec = kernels.AttentionSpec.peagle(a, d, c)
        pre = model(tok, model.fuse(aux_rows), positions, None, spec, backend).prenorm  # logits never built here
        loss_idx = jnp.concatenate([own0, length + jnp.arange(r)])
        owned = jnp.concatenate([jnp.broadcast_to(owned0, (bsz, c0)), valid], axis=1)
        la, ld, lc = a[:, loss_idx], d[:, loss_idx], c[:, loss_idx]
        kl, hit, mask = row_loss(model, pre[:, loss_idx], la, ld, lc, owned)
        onehot = jax.nn.one_hot(ld, k, dtype=jnp.float32)
        if per_depth:
            loss = jnp.sum(jnp.sum(onehot * kl[..., None], axis=(0, 1)) * depth_weight)
        else:
            loss = jnp.sum(kl) / (rows_total + EPS)
        return loss, (onehot, hit, mask, owned, loss_idx)

    def chain(model, s, idx):
        a, d, c, valid, own0, owned0 = rows_of(s, idx)
        width = r // (k - 1) if k > 1 else 0
        ref = jnp.clip(a + d, 0, length - 1)
        tok = take_rows(row_tok, ref)  # teacher-forced tokens at every step
        hidden = [model.fuse(aux.astype(jnp.float32))]
        loss = jnp.zeros((), jnp.float32)
        hits, masks, owns = [], [], []
        for j in range(k):
            m = length + j * width
            aj, dj, cj = a[:, :m], d[:, :m], c[:, :m]
            spec = kernels.AttentionSpec.peagle(aj, dj, cj)
            pos = jnp.where(cj >= 0, aj + dj, -1)
            pre_all = model(tok[:, :m], jnp.concatenate(hidden, axis=1), pos, None, spec, backend).prenorm
            if j == 0:
                sl = own0
                own = jnp.broadcast_to(owned0, (bsz, c0))
                nxt = take_rows(pre_all, jnp.clip(a[:, length : length + width], 0, length - 1))  # step 1's anchors
            else:
                sl = length + (j - 1) * width + jnp.arange(width)
                own = valid[:, (j - 1) * width : j * width]
                nxt = pre_all[:, sl]
            kl, hit, mask = row_loss(model, pre_all[:, sl], a[:, sl], d[:, sl], c[:, sl], own)
            loss = loss + (chain_decay**j) * jnp.sum(kl) / (counts[j] + EPS)
            hidden.append(model.feedback(nxt))
            hits.append(hit), masks.append(mask), owns.append(own)
        loss_idx = jnp.concatenate([own0, length + jnp.arange(r)])
        onehot = jax.nn.one_hot(d[:, loss_idx], k, dtype=jnp.float32)
        hit, mask, owned = (jnp.concatenate(x, axis=1) for x in (hits, masks, owns))
        return loss, (onehot, hit, mask, owned, loss_idx)

    def segment(p, s, idx):
        model = parts.merge(p, frozen)
        return (parallel if mode == "parallel" else chain)(model, s, idx)

    def body(carry, xs):
        gacc, loss, correct, total, hit_all = carry
        s, idx = xs
        if with_grads:
            (ls, (onehot, hit, mask, owned, loss_idx)), g = jax.value_and_grad(segment, has_aux=True)(params, s, idx)
            gacc = jax.tree.map(lambda acc, x: acc + x.astype(jnp.float32), gacc, g)
        else:
            ls, (onehot, hit, mask, owned, loss_idx) = segment(params, s, idx)
        weighted = onehot * mask[..., None]
        correct = correct + jnp.sum(weighted * hit[..., None], axis=(0, 1))
        total = total + jnp.sum(weighted, axis=(0, 1))
        # hits back to the batch's row order (rows not owned here go to index n: dropped)
        dest = jnp.where(owned, jnp.concatenate([jnp.broadcast_to(loss_idx[:c0], (bsz, c0)), idx], axis=1), n)
        hit_all = hit_all.at[jnp.arange(bsz)[:, None], dest].set(hit, mode="drop")
        return (gacc, loss + ls, correct, total, hit_all), None

    zeros_k = jnp.zeros((k,), jnp.float32)
    gacc0 = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params) if with_grads else None
    init = (gacc0, jnp.zeros((), jnp.float32), zeros_k, zeros_k, jnp.zeros((bsz, n), bool))
    (gacc, loss, correct, total, hit), _ = jax.lax.scan(body, init, (jnp.arange(nseg), seg_rows))
    grads = jax.tree.map(lambda g, x: g.astype(x.dtype), gacc, params) if with_grads else None
    metrics = {"loss": loss, "correct": correct, "total": total, "hit": hit, "sup": sup}
    return loss, metrics, grads
