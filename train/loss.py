"""The P-EAGLE training loss and per-depth metrics (docs/method.md section 5).

Teacher: the target's distribution at a row's reference position, restricted to the draft
vocabulary (softmax over the target logits of the draft ids, in draft-id order); draft:
the drafter's logits [.., Vd]. Loss = forward KL(teacher || draft) per row, summed over
supervised rows (loss mask at ref, optionally also "the target's argmax is in the draft
vocabulary") and divided ONCE by the supervised row count (pass `normalizer` = the count
of the whole batch when a sequence is split into segments). `per_depth=True` instead
averages within each depth, then over the depths that have rows (an early port's variant).

This matches speculators 0.9.0 (`kl_div_loss` + `loss_function`: sum(kl * mask) /
(sum(mask) + 1e-5)) exactly: the same 1e-5 (`EPS`) is added to the denominator (it also
makes a batch with no supervised row give loss 0). Which rows a loss sums, at which depth,
reading which teacher position, and how they are weighed: `LossRows`.

Two forms of it: `draft_loss` over given logits (the reference: the golden vectors and
speculators' arithmetic pin it) and `fused_draft_loss`, what the trainer runs: the same loss
and gradients from the head's inputs, the head's product inside it, supervised rows only
(tests/test_train_loss.py holds the two equal).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from peagle_jax.models.eagle import draft_vocab_ids

__all__ = [
    "EPS",
    "LossOutput",
    "LossRows",
    "restrict_to_draft",
    "teacher_logits",
    "argmax_in_draft",
    "TeacherDist",
    "teacher_dist",
    "loss_target",
    "forward_kl",
    "fused_kl",
    "fused_draft_loss",
    "top1_hit",
    "top_index",
    "draft_loss",
    "acceptance_length",
    "take_rows",
    "next_rows",
]


EPS = 1e-5  # the denominator's epsilon of every normalisation (speculators 0.9.0's _LOSS_REDUCTION_EPS)


def take_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, L, ...] gathered along axis 1 at idx [B, M] (per sequence) or [M] (the same for all)."""
    if idx.ndim == 1:
        return jnp.take(x, idx, axis=1)
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def next_rows(x: jax.Array, n: int = 1) -> jax.Array:
    """Row t gets x[:, t + n] (zeros past the end). n = 1 is the EAGLE shift: row t holds token
    x[t + 1] and its teacher is the target's state at t + 1; the chain objective's step j
    shifts by j more."""
    return jnp.concatenate([x[:, n:], jnp.zeros_like(x[:, :n])], axis=1)


class LossOutput(NamedTuple):
    loss: jax.Array  # scalar float32
    loss_sum: jax.Array  # sum of per-row KL over the supervised rows
    rows: jax.Array  # number of supervised rows (float32)
    correct: jax.Array  # [K] top-1 hits per depth (supervised rows)
    total: jax.Array  # [K] supervised rows per depth
    hit: jax.Array  # [...] bool: the teacher's top token is the draft's (`top1_hit`); every row
    # from `draft_loss`, the supervised rows only from `fused_draft_loss` (False elsewhere)


class LossRows(NamedTuple):
    """The rows a loss sums over, and how it weighs them.

    mask [...]: the supervised rows (loss mask at ref, times any extra row filter such as
    `argmax_in_draft`); depth [...] int in [0, num_depths) (None: all depth 0), for the per-depth
    metrics. teacher_rows [B, N]: with a teacher per position [B, P, Vd], row i reads position
    teacher_rows[:, i] (None: the teacher is per row); teacher_top [...]: the teacher's top token
    of each row when the caller has it (one per token, not per row), else it is computed.
    Weights: each supervised row 1 / (supervised rows + EPS), `normalizer` standing for the count
    (the global count when rows are split over segments); per_depth: the mean within each depth,
    then over the depths that have rows; row_weight [B, N] or scalar: given per row instead (the
    caller's normalisation: segments; `fused_draft_loss` only)."""

    mask: jax.Array
    depth: jax.Array | None = None
    num_depths: int = 1
    teacher_rows: jax.Array | None = None
    teacher_top: jax.Array | None = None
    per_depth: bool = False
    normalizer: jax.Array | float | None = None
    row_weight: jax.Array | float | None = None

    def depths(self) -> jax.Array:
        """The depth of each row (0 when not given)."""
        return jnp.zeros(self.mask.shape, jnp.int32) if self.depth is None else self.depth


def restrict_to_draft(target_logits: jax.Array, d2t: jax.Array) -> jax.Array:
    """[..., V] target logits -> [..., Vd]: column i is target id i + d2t[i]."""
    return jnp.take(target_logits, draft_vocab_ids(d2t), axis=-1)


def teacher_logits(y: jax.Array, lm_head: jax.Array, d2t: jax.Array | None, *, softcap: float | None = None):
    """Restricted teacher logits [..., Vd] (float32) from the target's final-norm output
    y [..., H] and its lm_head weight [V, H] (PyTorch layout; the tied embedding for tied
    targets): only the draft-vocabulary rows are multiplied. d2t None: lm_head holds those
    rows already ([Vd, H], gathered once on the host: the trainer)."""
    w = lm_head
    if d2t is not None:
        w = jnp.take(lm_head, draft_vocab_ids(d2t), axis=0)
    logits = jnp.einsum(
        "...h,vh->...v", y.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    return softcap * jnp.tanh(logits / softcap) if softcap else logits


def argmax_in_draft(target_logits: jax.Array, t2d: jax.Array) -> jax.Array:
    """[...] bool: the full-vocabulary argmax of the target is a draft-vocabulary token."""
    return t2d[jnp.argmax(target_logits, axis=-1)]


class TeacherDist(NamedTuple):
    """The teacher's distribution per position (no gradient): what the KL reads of it."""

    p: jax.Array  # [..., Vd] float32 probabilities
    neg_entropy: jax.Array  # [...] sum p log p
    mass: jax.Array  # [...] sum p (1 up to rounding; the KL's lse term is weighted by it)


def teacher_dist(teacher: jax.Array) -> TeacherDist:
    """softmax of restricted teacher logits [..., Vd], with its sum p log p and mass."""
    logp = jax.nn.log_softmax(jax.lax.stop_gradient(teacher).astype(jnp.float32), axis=-1)
    p = jnp.exp(logp)
    return TeacherDist(p, jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1), jnp.sum(p, axis=-1))


def loss_target(teacher: jax.Array, ce_weight: float = 0.0, top: jax.Array | None = None) -> TeacherDist:
    """What the loss pulls the draft towards, per position, from restricted teacher logits
    [..., Vd]: (1 - ce_weight) x the teacher's softmax + ce_weight x the one-hot on its top token
    (`top` [...], computed when not given). Forward KL to it is (1 - w) x KL + w x the
    cross-entropy on the top token: 0 is forward KL, 1 is speculators' `ce`, between is their
    weighted combination {"kl_div": 1 - w, "ce": w}. The entropy and mass terms keep the value
    exact (cross-entropy has no entropy term; its log-sum-exp weighs 1)."""
    w = float(ce_weight)
    if w == 0.0:
        return teacher_dist(teacher)
    top = top_index(teacher) if top is None else top
    hard = jax.nn.one_hot(top, teacher.shape[-1], dtype=jnp.float32)
    if w == 1.0:
        return TeacherDist(hard, jnp.zeros(top.shape, jnp.float32), jnp.ones(top.shape, jnp.float32))
    p, neg_entropy, mass = teacher_dist(teacher)
    return TeacherDist((1.0 - w) * p + w * hard, (1.0 - w) * neg_entropy, (1.0 - w) * mass + w)


def forward_kl(draft_logits: jax.Array, teacher: jax.Array, rows: jax.Array | None = None) -> jax.Array:
    """Per-row KL(softmax(teacher) || softmax(draft)) [...], float32.

    teacher: logits [..., Vd] per row, or with `rows` [B, N] the logits [B, P, Vd] per position,
    row i reading position rows[:, i] (its entropy and mass are taken once per position). One
    custom gradient, softmax(draft) - teacher, instead of autodiff through two log-softmaxes:
    fewer passes over the [rows, Vd] logits (draft-vocabulary work of the 2048-token step
    5.1 -> 4.6 thread-s, `bench/train_speed.py --profile`)."""
    p, neg_entropy, mass = teacher_dist(teacher)
    if rows is not None:  # one copy of whole teacher rows, read by the forward and the backward
        p = jax.lax.optimization_barrier(jax.vmap(lambda x, i: jnp.take(x, i, axis=0, mode="clip"))(p, rows))
        neg_entropy, mass = take_rows(neg_entropy, rows), take_rows(mass, rows)
    return _kl_rows(draft_logits, p, neg_entropy, mass)


@jax.custom_vjp
def _kl_rows(z, p, neg_entropy, mass):
    """sum_v p (log p - log q) = sum p log p - sum p z + lse(z) sum p."""
    return _kl_rows_fwd(z, p, neg_entropy, mass)[0]


def _kl_rows_fwd(z, p, neg_entropy, mass):
    zf = z.astype(jnp.float32)
    lse = jax.nn.logsumexp(zf, axis=-1)
    # over [rows, Vd]: with a leading batch axis XLA's CPU backend rewrote the product-sum as
    # [1, Vd] x [Vd, 1] dots, 30x slower (1.5 s vs 51 ms at [1, 6656, 16384])
    flat = zf.shape[-1]
    cross = jnp.sum(p.reshape(-1, flat) * zf.reshape(-1, flat), axis=-1).reshape(lse.shape)
    kl = neg_entropy - cross + lse * mass
    return kl, (z, p, lse, mass)


def _kl_rows_bwd(res, g):
    z, p, lse, mass = res
    q = jnp.exp(z.astype(jnp.float32) - lse[..., None])
    dz = g[..., None] * (q * mass[..., None] - p)
    return dz.astype(z.dtype), None, None, None


_kl_rows.defvjp(_kl_rows_fwd, _kl_rows_bwd)


def top_index(x: jax.Array, chunk: int = 128) -> jax.Array:
    """[...] int32: the index of the largest entry along the last axis, the first of ties (what
    `jnp.argmax` returns; with a NaN the index is unspecified: the loss is NaN then anyway).

    In two levels: the max of each `chunk` entries, the first chunk holding the largest, the
    first largest in it. XLA's CPU backend runs argmax as an index-tracking reduce at ~1/10 of a
    max's speed (137 vs 16 ms over [4096, 16384])."""
    v = x.shape[-1]
    if v % chunk or v <= chunk:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    blocks = x.reshape(x.shape[:-1] + (v // chunk, chunk))
    first = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1).astype(jnp.int32)
    inside = jnp.take_along_axis(blocks, first[..., None, None], axis=-2)[..., 0, :]
    return first * chunk + jnp.argmax(inside, axis=-1).astype(jnp.int32)


def top1_hit(draft_logits: jax.Array, teacher_top: jax.Array) -> jax.Array:
    """[...] bool: the teacher's top token (draft ids [...]) is a top token of the draft.

    The draft's logit there against its maximum (the max the log-softmax computes anyway)
    instead of a second argmax over [.., Vd]: an index-tracking reduce that XLA's CPU backend
    runs at a third of a max's speed (~0.3 s of a 4 s step at 1792 rows). A tie between the
    teacher's top token and another draft token counts as a hit (argmax would pick one)."""
    x = jax.lax.stop_gradient(draft_logits).astype(jnp.float32)
    vocab, top = x.shape[-1], teacher_top.astype(jnp.int32)
    flat = jnp.arange(top.size, dtype=jnp.int32).reshape(top.shape) * vocab + top  # one scalar per row
    return jnp.take(x.reshape(-1), flat) >= jnp.max(x, axis=-1)


def draft_loss(draft_logits: jax.Array, teacher: jax.Array, rows: LossRows) -> LossOutput:
    """Loss and per-depth top-1 metrics over `rows` (`LossRows`; no row_weight here).

    draft_logits [..., Vd]; teacher [..., Vd] restricted to the draft vocabulary, per row or
    per position (`rows.teacher_rows`, `forward_kl`). Accuracy: the teacher's top token is the
    draft's (`top1_hit`), counted over supervised rows.
    """
    if rows.row_weight is not None:
        raise ValueError("draft_loss weighs rows by their count: row weights are fused_draft_loss's")
    mask = rows.mask.astype(jnp.float32)
    kl = forward_kl(draft_logits, teacher, rows.teacher_rows)
    onehot = jax.nn.one_hot(rows.depths(), rows.num_depths, dtype=jnp.float32) * mask[..., None]  # [..., K]
    axes = tuple(range(mask.ndim))
    total = jnp.sum(onehot, axis=axes)
    teacher_top = rows.teacher_top
    if teacher_top is None:
        teacher_top = top_index(teacher)
        teacher_top = teacher_top if rows.teacher_rows is None else take_rows(teacher_top, rows.teacher_rows)
    hit = top1_hit(draft_logits, teacher_top)
    correct = jnp.sum(onehot * hit[..., None].astype(jnp.float32), axis=axes)
    count = jnp.sum(mask)
    loss_sum = jnp.sum(kl * mask)
    if rows.per_depth:
        per = jnp.sum(onehot * kl[..., None], axis=axes) / jnp.maximum(total, 1.0)
        present = (total > 0).astype(jnp.float32)
        loss = jnp.sum(per * present) / jnp.maximum(jnp.sum(present), 1.0)
    else:
        denom = count if rows.normalizer is None else jnp.asarray(rows.normalizer, jnp.float32)
        loss = loss_sum / (denom + EPS)
    return LossOutput(loss, loss_sum, count, correct, total, hit)


def fused_kl(hn, w, teacher: TeacherDist, rows, weights, top, *, chunk: int = 2048):
    """(loss, kl, hit) of draft rows from the lm_head's inputs, the [rows, Vd] logits never whole.

    hn [B, N, H], w [H, Vd] (`DrafterModel.head_inputs`); teacher: `teacher_dist` per position
    [B, P, ...]; rows [B, N]: the teacher position of each row; weights [B, N] float32; top [B, N]:
    the teacher's top draft token of each row. loss = sum_r weights_r KL_r (the only
    differentiable output); kl [B, N] per row and hit [B, N] (`top1_hit`'s rule) are given for
    the rows with a weight and are 0 / False elsewhere: rows without a weight (no loss: padding,
    prompt tokens) are never multiplied by the vocabulary.

    The rows with a weight are taken ~`chunk` at a time (N cut into equal pieces; a loop of as
    many pieces as the fullest sequence's weighted rows fill; pieces of 512 rows made the
    products ~15% slower than one [N, Vd] product on XLA CPU, ~2048 as fast), each piece's
    logits, softmax and KL computed and dropped. Under differentiation the same pass forms the
    piece's gradient (the loss is linear in the weighted KLs: weights x (softmax(z) mass - p) is
    all it needs) and only dh [B, N, H] (and dW when w is differentiated) are kept."""
    return _fused(chunk, hn, w, teacher, rows, weights, top)


def _fused_pass(chunk, hn, w, teacher: TeacherDist, rows, weights, top, want: tuple[bool, bool]):
    """`fused_kl`'s loop: (loss, kl, hit, dh, dw), dh / dw formed when `want` (dh, dw) asks."""
    f32 = jnp.float32
    p, neg_entropy, mass = teacher
    want_dh, want_dw = want
    b, n, h = hn.shape
    vd = w.shape[-1]
    pieces = max(1, -(-n // chunk))
    chunk = max(8, -(-n // (8 * pieces)) * 8)  # equal pieces of ~chunk rows (multiples of 8): little padding
    n_pad = pieces * chunk
    pad = lambda x: jnp.pad(x, ((0, 0), (0, n_pad - n)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
    hn_, rows_, wt_, top_ = pad(hn), pad(rows), pad(weights.astype(f32)), pad(top)
    active = wt_ != 0
    order = jnp.argsort(~active, axis=1, stable=True).astype(jnp.int32)  # rows with a weight first
    trips = (jnp.max(jnp.sum(active, axis=1)) + chunk - 1) // chunk
    seq = jnp.arange(b)[:, None]
    ref = rows_ + seq * p.shape[1]  # into the flattened [B * P] teacher
    p2, ne1, mass1 = p.reshape(-1, vd), neg_entropy.reshape(-1), mass.reshape(-1)

    def body(i, carry):
        loss, kl_all, hit_all, dh, dw = carry
        idx = jax.lax.dynamic_slice_in_dim(order, i * chunk, chunk, axis=1)  # [B, c]
        # everything over [B * c] rows: with a leading batch axis XLA's CPU backend turns the
        # product-sums into slow per-row dots (see `_kl_rows_fwd`)
        hc = hn_[seq, idx].reshape(-1, h)
        wc, rc = wt_[seq, idx].reshape(-1), ref[seq, idx].reshape(-1)
        z = jnp.dot(hc, w, preferred_element_type=f32)  # [B * c, Vd]
        m = jnp.max(z, axis=-1)
        e = jnp.exp(z - m[:, None])
        s = jnp.sum(e, axis=-1)
        pc = jnp.take(p2, rc, axis=0)
        kl = ne1[rc] - jnp.sum(pc * z, axis=-1) + (m + jnp.log(s)) * mass1[rc]
        on = wc != 0
        kl = jnp.where(on, kl, 0.0)
        t = top_[seq, idx].reshape(-1)
        hit = on & (jnp.take_along_axis(z, t[:, None].astype(jnp.int32), axis=-1)[:, 0] >= m)
        loss = loss + jnp.sum(wc * kl)
        kl_all = kl_all.at[seq, idx].set(kl.reshape(b, chunk))
        hit_all = hit_all.at[seq, idx].set(hit.reshape(b, chunk))
        if want_dh or want_dw:
            dz = (wc * mass1[rc] / s)[:, None] * e - wc[:, None] * pc  # d loss / d z
            if want_dh:
                dhc = jnp.dot(dz.astype(w.dtype), w.T, preferred_element_type=f32).astype(dh.dtype)
                dh = dh.at[seq, idx].set(dhc.reshape(b, chunk, h))
            if want_dw:
                dw = dw + jnp.dot(hc.T, dz.astype(hc.dtype), preferred_element_type=f32)
        return loss, kl_all, hit_all, dh, dw

    init = (
        jnp.zeros((), f32),
        jnp.zeros((b, n_pad), f32),
        jnp.zeros((b, n_pad), bool),
        jnp.zeros((b, n_pad, h), hn.dtype) if want_dh else None,
        jnp.zeros((h, vd), f32) if want_dw else None,
    )
    loss, kl, hit, dh, dw = jax.lax.fori_loop(0, trips, body, init)
    return loss, kl[:, :n], hit[:, :n], None if dh is None else dh[:, :n], dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(chunk, hn, w, teacher, rows, weights, top):
    return _fused_pass(chunk, hn, w, teacher, rows, weights, top, (False, False))[:3]


def _fused_fwd(chunk, hn, w, teacher, rows, weights, top):
    args = jax.tree.map(lambda x: x.value, (hn, w, teacher, rows, weights, top))
    loss, kl, hit, dh, dw = _fused_pass(chunk, *args, (hn.perturbed, w.perturbed))
    return (loss, kl, hit), (dh, None if dw is None else dw.astype(w.value.dtype))


def _fused_bwd(chunk, res, g):
    dh, dw = res
    g_loss, g_kl, _ = g
    if not isinstance(g_kl, jax.custom_derivatives.SymbolicZero):
        raise ValueError("fused_kl: differentiate the loss (its first output), not the per-row kl")
    if isinstance(g_loss, jax.custom_derivatives.SymbolicZero):
        return (None,) * 6
    dh = None if dh is None else (g_loss * dh).astype(dh.dtype)
    dw = None if dw is None else (g_loss * dw).astype(dw.dtype)
    return (dh, dw) + (None,) * 4


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


def fused_draft_loss(
    hn: jax.Array, w: jax.Array, teacher: jax.Array, rows: LossRows, *, ce_weight: float = 0.0, chunk: int = 2048
) -> LossOutput:
    """`draft_loss` of the rows whose logits are hn @ w (`DrafterModel.head_inputs`), through
    `fused_kl`: the same loss and gradients without the [rows, Vd] logits, and no vocabulary
    work for unsupervised rows: their `hit` is False (`draft_loss` gives every row's).
    With `rows.row_weight`, `loss` = sum_r mask_r weight_r KL_r. `ce_weight`: the share of
    cross-entropy on the teacher's top token in the loss (`loss_target`)."""
    mask = rows.mask.astype(jnp.float32)
    depth = rows.depths()
    onehot = jax.nn.one_hot(depth, rows.num_depths, dtype=jnp.float32) * mask[..., None]  # [B, N, K]
    total = jnp.sum(onehot, axis=(0, 1))
    count = jnp.sum(mask)
    if rows.row_weight is not None:
        weight = mask * rows.row_weight
    elif rows.per_depth:  # the mean within each depth, then over the depths with rows (`draft_loss`)
        present = (total > 0).astype(jnp.float32)
        weight = mask * jnp.take(present / jnp.maximum(total, 1.0) / jnp.maximum(jnp.sum(present), 1.0), depth)
    else:
        denom = count if rows.normalizer is None else jnp.asarray(rows.normalizer, jnp.float32)
        weight = mask / (denom + EPS)
    teacher_rows, teacher_top = rows.teacher_rows, rows.teacher_top
    if teacher_rows is None:
        teacher_rows = jnp.broadcast_to(jnp.arange(mask.shape[1], dtype=jnp.int32), mask.shape)
    top = top_index(teacher) if teacher_top is None or ce_weight else None  # per position, once
    if teacher_top is None:
        teacher_top = take_rows(top, teacher_rows)
    target = loss_target(teacher, ce_weight, top)
    loss, kl, hit = fused_kl(hn, w, target, teacher_rows, weight, teacher_top, chunk=chunk)
    correct = jnp.sum(onehot * hit[..., None].astype(jnp.float32), axis=(0, 1))
    return LossOutput(loss, jnp.sum(kl), count, correct, total, hit)


def acceptance_length(per_depth_acc) -> jax.Array:
    """Simulated tau = 1 + sum_k prod_{i<=k} acc_i from per-depth (conditional) accuracies."""
    acc = jnp.asarray(per_depth_acc, jnp.float32)
    return 1.0 + jnp.sum(jnp.cumprod(acc))
