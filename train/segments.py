"""Exact sequence partitioning (docs/method.md section 5): one step over S segments.

Segment of a row: seg = ((anchor if depth == 0 else anchor + 1) * S) // L, clamped to
[0, S - 1], L = the row-space length of the batch. The depth-0 rows (rows [0, L) of a batch are
the depth-0 rows of anchors 0..L-1) run once per step, before the segments: their pre-norm states
and per-layer keys and values are the context every segment reads. Segment s then runs forward +
backward over its own deeper rows (depth >= 1, packed on the host into R slots per segment:
`segment_rows`, the batch key "seg_rows" [B, S, R]), attending to the context's K/V (the drafter's
`context` argument), and takes its loss over its own rows only: the depth-0 rows with seg == s (a
contiguous anchor range, one static-size slice of the context's states) plus its deeper rows,
divided by the WHOLE batch's counts. The segment losses therefore sum to the flat loss. A
`lax.scan` accumulates each segment's gradient with respect to the parameters and to the
context's states and K/V; one VJP of the depth-0 pass turns the summed context cotangents into
its parameter gradient, so the total is the flat gradient. One segment's activations and its
[rows / S, Vd] logits and teacher are alive at a time (the teacher is computed per row from the
target's final-norm states, never as the flat pass's [L, Vd] table), plus the depth-0 pass's.

Chain mode (EAGLE-3 training-time test) uses the same segments: the depth-0 pass is step 0, the
segment's rows of steps 1..k-1 are packed step by step into W slots each (the same anchors at
every step), so step j's hidden input is the previous step's pre-norm state of the same slot, and
its keys are the context's plus the earlier steps' of the segment.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import kernels
from train.loss import EPS, LossRows, fused_draft_loss, next_rows, take_rows, teacher_logits
from train.spec import LossSpec

__all__ = [
    "attention_for",
    "segment_bounds",
    "row_segments",
    "resolve_segments",
    "segment_rows",
    "segmented_loss",
    "SegmentedPass",
]


def attention_for(attention: str, rows: int) -> str:
    """`--model.attention auto`: one dense [rows, rows] mask for up to kernels.DENSE_MAX_ROWS rows (it
    compiles faster), the blockwise kernels beyond (they skip masked blocks: 1.4x faster per
    step already at 1792 rows on CPU, bench/train_speed.py)."""
    if attention == "auto":
        return "dense" if rows <= kernels.DENSE_MAX_ROWS else "kernels"
    return attention


def segment_bounds(length: int, segments: int) -> np.ndarray:
    """[S + 1]: segment s owns the depth-0 rows of anchors [b[s], b[s + 1]) (b[s] = ceil(s L / S))."""
    return np.array([-(-s * length // segments) for s in range(segments + 1)], np.int32)


def row_segments(anchor: np.ndarray, depth: np.ndarray, length: int, segments: int) -> np.ndarray:
    """The segment of each row (docs/method.md section 5)."""
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


def segmented_loss(parts, params, frozen, aux, y, head_w, batch, spec: LossSpec):
    """(loss, metrics, grads) of one batch over the segments of batch["seg_rows"]: the same
    values as `train.step.loss_and_metrics` (and its gradient) computed in one flat pass.
    Evaluation (no gradient): `SegmentedPass(...).run(params, with_grads=False)`."""
    return SegmentedPass(parts, frozen, aux, y, head_w, batch, spec).run(params)


class SegmentedPass:
    """What every segment of one batch shares (traced arrays and static sizes), and the passes:
    the depth-0 rows once (`depth0`), then each segment's own rows (`parallel` / `chain`)."""

    def __init__(self, parts, frozen, aux, y, head_w, batch, spec: LossSpec):
        self.parts, self.frozen, self.aux, self.head_w, self.batch = parts, frozen, aux, head_w, batch
        self.spec, self.mode, self.k = spec, spec.mode, spec.k
        anchor, depth, doc = batch["anchor"], batch["depth"], batch["doc"]
        self.anchor, self.depth, self.doc = anchor, depth, doc
        self.bsz, self.n = anchor.shape
        length = self.length = aux.shape[1]
        self.seg_rows = jnp.moveaxis(jnp.asarray(batch["seg_rows"], jnp.int32), 1, 0)  # [S, B, R]
        self.nseg, _, self.r = self.seg_rows.shape
        self.bounds = jnp.asarray(segment_bounds(length, self.nseg))
        self.c0 = -(-length // self.nseg)  # depth-0 rows a segment owns, at most
        self.backend = "auto" if attention_for(spec.attention, length + self.r) == "kernels" else "dense"
        self.row_tok = next_rows(batch["tokens"])  # row t: x[t + 1]
        self.y_next = next_rows(y)  # row t's teacher: the target at t + 1
        ref_all = jnp.clip(anchor + depth, 0, length - 1)
        self.sup = sup = take_rows(batch["sup"], ref_all) & (doc >= 0)
        # whole-batch counts: every segment divides by these, so the segments sum to the flat loss
        self.counts = counts = jnp.sum(jax.nn.one_hot(depth, self.k, dtype=jnp.float32) * sup[..., None], axis=(0, 1))
        self.rows_total = jnp.sum(sup.astype(jnp.float32))
        present = (counts > 0).astype(jnp.float32)
        self.depth_weight = present / jnp.maximum(counts, 1.0) / jnp.maximum(jnp.sum(present), 1.0)
        self.ctx = (anchor[:, :length], depth[:, :length], doc[:, :length])

    def run(self, params, with_grads: bool = True):
        """(loss, metrics, grads) over every segment; grads None without `with_grads` (evaluation)."""
        if with_grads:
            (pre0, kv0), depth0_vjp = jax.vjp(self.depth0, params)
        else:
            pre0, kv0 = self.depth0(params)
        f32 = functools.partial(jax.tree.map, lambda x: jnp.zeros(x.shape, jnp.float32))
        zeros_k = jnp.zeros((self.k,), jnp.float32)
        gacc0 = f32((params, pre0, kv0)) if with_grads else None
        init = (gacc0, jnp.zeros((), jnp.float32), zeros_k, zeros_k, jnp.zeros((self.bsz, self.n), bool))
        body = functools.partial(self.scan_body, params, pre0, kv0, with_grads)
        (gacc, loss, correct, total, hit), _ = jax.lax.scan(body, init, (jnp.arange(self.nseg), self.seg_rows))
        grads = None
        if with_grads:  # the segments' gradients, plus the depth-0 pass's from their summed cotangents
            g_params, g_pre0, g_kv0 = gacc
            cast = functools.partial(jax.tree.map, lambda g, x: g.astype(x.dtype))
            (g_depth0,) = depth0_vjp((cast(g_pre0, pre0), cast(g_kv0, kv0)))
            grads = jax.tree.map(
                lambda a, b, x: (a + b.astype(jnp.float32)).astype(x.dtype), g_params, g_depth0, params
            )
        metrics = {"loss": loss, "correct": correct, "total": total, "hit": hit, "sup": self.sup}
        return loss, metrics, grads

    def depth0(self, p):
        """The depth-0 rows, once for every segment: pre-norm states [B, L, H] and per layer the
        (k, v) the segments' deeper rows attend to."""
        model = self.parts.merge(p, self.frozen)
        ctx_a, ctx_d, ctx_c = self.ctx
        hidden = self.aux.astype(model.mask_hidden.dtype if self.mode == "parallel" else jnp.float32)
        spec = kernels.AttentionSpec.peagle(ctx_a, ctx_d, ctx_c)
        g = model.fuse(hidden)
        context = model.empty_context(self.bsz, g.dtype)
        positions = jnp.where(ctx_c >= 0, ctx_a, -1)
        res = model(self.row_tok, g, positions, None, spec, self.backend, context=context)
        return res.prenorm, res.cache

    def rows_of(self, s, idx):
        """Metadata of the segment's deeper rows (R) and the depth-0 rows it owns."""
        n, length, c0 = self.n, self.length, self.c0
        valid = idx < n
        ii = jnp.minimum(idx, n - 1)
        a, d = take_rows(self.anchor, ii), take_rows(self.depth, ii)
        c = jnp.where(valid, take_rows(self.doc, ii), -1)
        # the depth-0 rows it owns: one static-size slice, rows outside [lo, hi) masked
        start = jnp.minimum(self.bounds[s], length - c0)
        own0 = start + jnp.arange(c0)
        owned0 = (own0 >= self.bounds[s]) & (own0 < self.bounds[s + 1])
        return a, d, c, valid, own0, owned0

    def spec_over_context(self, q, rows):
        """The P-EAGLE rule for query rows q = (anchor, depth, doc) over the depth-0 rows, then
        `rows` (the segment's rows run so far, q's last)."""
        cat = functools.partial(jnp.concatenate, axis=1)
        kv = (cat([ctx, x]) for ctx, x in zip(self.ctx, rows))
        return kernels.AttentionSpec.make(*q, *kv, chain_depth=self.k - 1)

    def row_loss(self, model, pre, la, ld, lc, owned, weight):
        """(sum of weight x KL, hits, mask) of loss rows from their pre-norm states (teacher per
        row, at ref); weight: per row [B, R] or one for all."""
        ref = jnp.clip(la + ld, 0, self.length - 1)
        teacher = teacher_logits(take_rows(self.y_next, ref), self.head_w, None, softcap=self.spec.softcap)
        mask = take_rows(self.batch["sup"], ref) & (lc >= 0) & owned  # the loss normalises the teacher
        rows = LossRows(mask, row_weight=weight)
        out = fused_draft_loss(*model.head_inputs(pre), teacher, rows, ce_weight=self.spec.ce_weight)
        return out.loss, out.hit, mask.astype(jnp.float32)

    def parallel(self, model, s, idx, pre0, kv0):
        bsz, c0 = self.bsz, self.c0
        a, d, c, valid, own0, owned0 = self.rows_of(s, idx)
        positions = jnp.where(c >= 0, a + d, -1)
        spec = self.spec_over_context((a, d, c), (a, d, c))
        every_row_the_slot = jnp.full((bsz, self.r), -1, jnp.int32)  # deeper rows: the mask slot's inputs
        res = model(None, None, positions, None, spec, self.backend, context=kv0, source=every_row_the_slot)
        owned = jnp.concatenate([jnp.broadcast_to(owned0, (bsz, c0)), valid], axis=1)
        la = jnp.concatenate([jnp.broadcast_to(own0, (bsz, c0)), a], axis=1)
        ld = jnp.concatenate([jnp.zeros((bsz, c0), d.dtype), d], axis=1)
        lc = jnp.concatenate([take_rows(self.ctx[2], own0), c], axis=1)
        pre = jnp.concatenate([take_rows(pre0, own0), res.prenorm], axis=1)  # logits never built for all rows
        weight = jnp.take(self.depth_weight, ld) if self.spec.per_depth else 1.0 / (self.rows_total + EPS)
        loss, hit, mask = self.row_loss(model, pre, la, ld, lc, owned, weight)
        onehot = jax.nn.one_hot(ld, self.k, dtype=jnp.float32)
        return loss, (onehot, hit, mask, owned, own0)

    def chain(self, model, s, idx, pre0, kv0):
        bsz, c0, k, length = self.bsz, self.c0, self.k, self.length
        a, d, c, valid, own0, owned0 = self.rows_of(s, idx)
        width = self.r // (k - 1) if k > 1 else 0
        tok = take_rows(self.row_tok, jnp.clip(a + d, 0, length - 1))  # teacher-forced tokens at every step
        # step 0 is the depth-0 pass; its states at step 1's anchors feed step 1
        ctx_c0 = take_rows(self.ctx[2], own0)
        w0 = 1 / (self.counts[0] + EPS)
        loss, hit, mask = self.row_loss(model, take_rows(pre0, own0), own0, jnp.zeros_like(own0), ctx_c0, owned0, w0)
        hits, masks, owns = [hit], [mask], [jnp.broadcast_to(owned0, (bsz, c0))]
        hidden = model.feedback(take_rows(pre0, jnp.clip(a[:, :width], 0, length - 1)))
        context = kv0
        for j in range(1, k):  # step j runs its own rows over the keys the earlier steps left
            lo, hi = (j - 1) * width, j * width
            aj, dj, cj = a[:, lo:hi], d[:, lo:hi], c[:, lo:hi]
            spec = self.spec_over_context((aj, dj, cj), (a[:, :hi], d[:, :hi], c[:, :hi]))
            positions = jnp.where(cj >= 0, aj + dj, -1)
            res = model(tok[:, lo:hi], hidden, positions, None, spec, self.backend, context=context)
            context = model.extend_context(context, res.cache)
            own = valid[:, lo:hi]
            wj = self.spec.chain_decay**j / (self.counts[j] + EPS)
            lj, hit, mask = self.row_loss(model, res.prenorm, aj, dj, cj, own, wj)
            loss = loss + lj
            hidden = model.feedback(res.prenorm)
            hits.append(hit), masks.append(mask), owns.append(own)
        onehot = jax.nn.one_hot(jnp.concatenate([jnp.zeros((bsz, c0), d.dtype), d], axis=1), k, dtype=jnp.float32)
        hit, mask, owned = (jnp.concatenate(x, axis=1) for x in (hits, masks, owns))
        return loss, (onehot, hit, mask, owned, own0)

    def segment(self, p, s, idx, pre0, kv0):
        model = self.parts.merge(p, self.frozen)
        return (self.parallel if self.mode == "parallel" else self.chain)(model, s, idx, pre0, kv0)

    def scan_body(self, params, pre0, kv0, with_grads, carry, xs):
        """One segment: its loss, gradients (accumulated in float32), counts and hits."""
        gacc, loss, correct, total, hit_all = carry
        s, idx = xs
        if with_grads:
            grad_fn = jax.value_and_grad(self.segment, argnums=(0, 3, 4), has_aux=True)
            (ls, (onehot, hit, mask, owned, own0)), g = grad_fn(params, s, idx, pre0, kv0)
            gacc = jax.tree.map(lambda acc, x: acc + x.astype(jnp.float32), gacc, g)
        else:
            ls, (onehot, hit, mask, owned, own0) = self.segment(params, s, idx, pre0, kv0)
        weighted = onehot * mask[..., None]
        correct = correct + jnp.sum(weighted * hit[..., None], axis=(0, 1))
        total = total + jnp.sum(weighted, axis=(0, 1))
        # hits back to the batch's row order (rows not owned here go to index n: dropped)
        bsz, c0 = self.bsz, self.c0
        dest = jnp.where(owned, jnp.concatenate([jnp.broadcast_to(own0, (bsz, c0)), idx], axis=1), self.n)
        hit_all = hit_all.at[jnp.arange(bsz)[:, None], dest].set(hit, mode="drop")
        return (gacc, loss + ls, correct, total, hit_all), None
