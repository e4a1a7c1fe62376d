"""The P-EAGLE training loss and per-depth metrics (reference/peagle.md section 5).

Teacher: the target's distribution at a row's reference position, restricted to the draft
vocabulary (softmax over the target logits of the draft ids, in draft-id order); draft:
the drafter's logits [.., Vd]. Loss = forward KL(teacher || draft) per row, summed over
supervised rows (loss mask at ref, optionally also "the target's argmax is in the draft
vocabulary") and divided ONCE by the supervised row count (pass `normalizer` = the count
of the whole batch when a sequence is split into segments). `per_depth=True` instead
averages within each depth, then over the depths that have rows (an early port's variant).

This matches speculators 0.9.0 (`kl_div_loss` + `loss_function`: sum(kl * mask) /
(sum(mask) + 1e-5)) exactly: the same 1e-5 (`eps`) is added to the denominator (it also
makes a batch with no supervised row give loss 0).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from peagle_jax.models.drafter import draft_vocab_ids

__all__ = [
    "LossOutput",
    "restrict_to_draft",
    "teacher_logits",
    "argmax_in_draft",
    "forward_kl",
    "top1_hit",
    "top_index",
    "draft_loss",
    "acceptance_length",
    "take_rows",
    "next_rows",
]


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
    hit: jax.Array  # [...] bool, every row: the teacher's top token is the draft's (`top1_hit`)


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


def forward_kl(draft_logits: jax.Array, teacher: jax.Array, rows: jax.Array | None = None) -> jax.Array:
    """Per-row KL(softmax(teacher) || softmax(draft)) [...], float32.

    teacher: logits [..., Vd] per row, or with `rows` [B, N] the logits [B, P, Vd] per position,
    row i reading position rows[:, i] (its entropy and mass are taken once per position). One
    custom gradient, softmax(draft) - teacher, instead of autodiff through two log-softmaxes:
    fewer passes over the [rows, Vd] logits (draft-vocabulary work of the 2048-token step
    5.1 -> 4.6 thread-s, `bench/train_speed.py --profile`)."""
    logp = jax.nn.log_softmax(jax.lax.stop_gradient(teacher).astype(jnp.float32), axis=-1)
    p = jnp.exp(logp)
    neg_entropy = jnp.sum(jnp.where(p > 0, p * logp, 0.0), axis=-1)  # per position: sum p log p
    mass = jnp.sum(p, axis=-1)
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


def draft_loss(
    draft_logits: jax.Array,
    teacher: jax.Array,
    row_mask: jax.Array,
    depth: jax.Array | None = None,
    *,
    num_depths: int = 1,
    per_depth: bool = False,
    normalizer: jax.Array | float | None = None,
    eps: float = 1e-5,
    teacher_top: jax.Array | None = None,
    teacher_rows: jax.Array | None = None,
) -> LossOutput:
    """Loss and per-depth top-1 metrics over rows.

    draft_logits, teacher [..., Vd] (teacher already restricted to the draft vocabulary);
    row_mask [...] (loss mask at ref, times any extra row filter such as
    `argmax_in_draft`); depth [...] int in [0, num_depths) (None = all depth 0).
    `normalizer`: the global supervised-row count when rows are split over segments
    (default: this call's count). Accuracy: the teacher's top token is the draft's
    (`top1_hit`), counted over supervised rows; `teacher_top` [...] gives the teacher's
    argmax when the caller has it (one per token, not per row), else it is computed here.
    `teacher_rows` [B, N]: teacher is per position [B, P, Vd], row i reads rows[:, i]
    (`forward_kl`); teacher_top is then per row.
    """
    mask = row_mask.astype(jnp.float32)
    kl = forward_kl(draft_logits, teacher, teacher_rows)
    if depth is None:
        depth = jnp.zeros(mask.shape, jnp.int32)
    onehot = jax.nn.one_hot(depth, num_depths, dtype=jnp.float32) * mask[..., None]  # [..., K]
    axes = tuple(range(mask.ndim))
    total = jnp.sum(onehot, axis=axes)
    if teacher_top is None:
        teacher_top = top_index(teacher)
        teacher_top = teacher_top if teacher_rows is None else take_rows(teacher_top, teacher_rows)
    hit = top1_hit(draft_logits, teacher_top)
    correct = jnp.sum(onehot * hit[..., None].astype(jnp.float32), axis=axes)
    rows = jnp.sum(mask)
    loss_sum = jnp.sum(kl * mask)
    if per_depth:
        per = jnp.sum(onehot * kl[..., None], axis=axes) / jnp.maximum(total, 1.0)
        present = (total > 0).astype(jnp.float32)
        loss = jnp.sum(per * present) / jnp.maximum(jnp.sum(present), 1.0)
    else:
        denom = rows if normalizer is None else jnp.asarray(normalizer, jnp.float32)
        loss = loss_sum / (denom + eps)
    return LossOutput(loss, loss_sum, rows, correct, total, hit)


def acceptance_length(per_depth_acc) -> jax.Array:
    """Simulated tau = 1 + sum_k prod_{i<=k} acc_i from per-depth (conditional) accuracies."""
    acc = jnp.asarray(per_depth_acc, jnp.float32)
    return 1.0 + jnp.sum(jnp.cumprod(acc))
