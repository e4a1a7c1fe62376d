"""The teacher over the draft vocabulary and the loss normalisation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from train.loss import (
    LossRows,
    draft_loss,
    forward_kl,
    fused_draft_loss,
    restrict_to_draft,
    take_rows,
    teacher_logits,
    top1_hit,
    top_index,
)


def test_teacher_equals_the_full_softmax_restricted_and_renormalised():
    rng = np.random.default_rng(0)
    v, h, vd = 300, 16, 40
    y = rng.standard_normal((5, h)).astype(np.float32)
    lm_head = rng.standard_normal((v, h)).astype(np.float32)
    used = np.sort(rng.choice(v, vd, replace=False))
    d2t = jnp.asarray(used - np.arange(vd))
    # only the [Vd, H] rows are multiplied (the trainer gathers them once: d2t None)
    t = jax.nn.softmax(teacher_logits(jnp.asarray(y), jnp.asarray(lm_head), d2t), -1)
    t_pre = jax.nn.softmax(teacher_logits(jnp.asarray(y), jnp.asarray(lm_head[used]), None), -1)
    full = np.exp(y @ lm_head.T - (y @ lm_head.T).max(-1, keepdims=True))
    full /= full.sum(-1, keepdims=True)
    want = full[:, used] / full[:, used].sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(t), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(t_pre), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(
        np.asarray(restrict_to_draft(jnp.asarray(y @ lm_head.T), d2t)), (y @ lm_head.T)[:, used], rtol=1e-5, atol=1e-5
    )


def test_global_normalisation_and_empty_batch():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((2, 6, 10)), jnp.float32)
    teacher = jnp.asarray(rng.standard_normal((2, 6, 10)), jnp.float32)
    mask = jnp.asarray(rng.random((2, 6)) < 0.5)
    depth = jnp.asarray(rng.integers(0, 3, (2, 6)))
    out = draft_loss(logits, teacher, LossRows(mask, depth, num_depths=3))
    assert abs(float(out.loss) - float(out.loss_sum) / (float(out.rows) + 1e-5)) < 1e-7
    assert int(out.total.sum()) == int(mask.sum())
    none = draft_loss(logits, teacher, LossRows(jnp.zeros((2, 6), bool), depth, num_depths=3))
    assert float(none.loss) == 0.0


def test_top1_hit_is_argmax_agreement_per_depth():
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((2, 40, 33)), jnp.float32)
    teacher = jnp.asarray(rng.standard_normal((2, 40, 33)), jnp.float32)
    top = jnp.argmax(teacher, -1)
    logits = logits.at[0, :20].set(teacher[0, :20] * 3)  # these rows agree, the rest by chance (~1/33)
    want = np.asarray(jnp.argmax(logits, -1) == top)
    assert want[0, :20].all()
    assert not want[1].all()
    np.testing.assert_array_equal(np.asarray(top1_hit(logits, top)), want)
    mask, depth = jnp.ones((2, 40), bool), jnp.asarray(rng.integers(0, 4, (2, 40)))
    a = draft_loss(logits, teacher, LossRows(mask, depth, num_depths=4))
    b = draft_loss(logits, teacher, LossRows(mask, depth, num_depths=4, teacher_top=top))
    want_correct = [want[np.asarray(depth) == d].sum() for d in range(4)]
    np.testing.assert_array_equal(np.asarray(a.correct), want_correct)
    np.testing.assert_array_equal(np.asarray(b.correct), want_correct)
    np.testing.assert_array_equal(np.asarray(a.hit), want)  # per row, every row (the trainer logs these)
    tie = jnp.asarray([[0.0, 2.0, 2.0]])  # the teacher's top token ties the draft's maximum: a hit
    assert bool(top1_hit(tie, jnp.asarray([2]))[0])
    assert not bool(top1_hit(tie, jnp.asarray([0]))[0])


def test_forward_kl_and_its_gradient_equal_autodiff_of_the_definition():
    """The custom-gradient KL (teacher per row, or per position read through `rows`) against
    autodiff of sum p (log p - log q), with a teacher that has exact zeros (p log p = 0 there)."""
    rng = np.random.default_rng(3)
    z = jnp.asarray(4 * rng.standard_normal((2, 9, 50)), jnp.float32)
    t = 6 * rng.standard_normal((2, 5, 50)).astype(np.float32)
    t[0, 1, :10] = -1e9  # p underflows to 0 on these ids
    t = jnp.asarray(t)
    rows = jnp.asarray(rng.integers(0, 5, (2, 9)), jnp.int32)
    w = jnp.asarray(rng.random((2, 9)), jnp.float32)

    def definition(z, teacher):
        logq, logp = jax.nn.log_softmax(z, -1), jax.nn.log_softmax(teacher, -1)
        return jnp.sum(jnp.where(logp > -jnp.inf, jnp.exp(logp) * (logp - logq), 0.0), -1)

    for got_fn, teacher in (
        (lambda z: forward_kl(z, t, rows), take_rows(t, rows)),
        (lambda z: forward_kl(z, t[:, :3]), t[:, :3]),
    ):
        zz = z if teacher.shape[1] == 9 else z[:, :3]
        want, want_g = jax.value_and_grad(lambda z: jnp.sum(definition(z, teacher) * w[:, : z.shape[1]]))(zz)
        got, got_g = jax.value_and_grad(lambda z: jnp.sum(got_fn(z) * w[:, : z.shape[1]]))(zz)
        np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(got_g), np.asarray(want_g), rtol=1e-4, atol=1e-6)
        assert float(jnp.max(jnp.abs(got_g))) > 1e-3  # a gradient that can be wrong


def test_top_index_is_argmax_first_of_ties():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 1024)).astype(np.float32)
    x[0, 0, [3, 700]] = 9.0  # ties in different chunks: the first
    x[0, 1, [130, 131]] = 9.0  # ties in one chunk
    x[0, 2, [1023, 5]] = 9.0
    x[1, 0, :] = 1.0  # all equal
    x[1, 1, [9, 600]] = -np.inf
    x[1, 2, 300] = np.inf
    for chunk in (128, 100, 2048):  # two levels, and the plain argmax when chunk does not divide
        got = top_index(jnp.asarray(x), chunk=chunk)
        np.testing.assert_array_equal(got, jnp.argmax(jnp.asarray(x), axis=-1))
    assert top_index(jnp.asarray(x)).dtype == jnp.int32


def test_fused_draft_loss_equals_draft_loss_on_the_logits_without_them():
    """`fused_draft_loss` (the head's product inside the loss, a few rows at a time, the rows
    without loss skipped) against `draft_loss` of the whole logits: loss, loss_sum, gradients of
    the states and of the lm_head kernel, per-depth hits; every normalisation; row counts that
    are no multiple of the chunk, sequences with different numbers of supervised rows (one with
    none), a teacher with exact zeros."""
    rng = np.random.default_rng(6)
    b, n, h, vd, positions = 3, 301, 16, 70, 120
    hn = jnp.asarray(rng.standard_normal((b, n, h)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((h, vd)), jnp.float32)
    t = 3 * rng.standard_normal((b, positions, vd)).astype(np.float32)
    t[1, :, :7] = -1e9  # p underflows to 0 on these ids
    rows_np = rng.integers(0, positions, (b, n))
    t[0, rows_np[0, :40]] = 5 * np.asarray(hn[0, :40] @ w)  # these rows' draft agrees with their teacher
    t = jnp.asarray(t)
    rows = jnp.asarray(rows_np, jnp.int32)
    mask = rng.random((b, n)) < np.array([[0.9], [0.3], [0.0]])  # the last sequence: no loss at all
    mask = jnp.asarray(mask)
    depth = jnp.asarray(rng.integers(0, 4, (b, n)), jnp.int32)
    row_weight = jnp.asarray(rng.random((b, n)), jnp.float32)
    cases = [
        dict(),
        dict(per_depth=True),
        dict(normalizer=jnp.float32(1000.0)),
    ]
    for kw in cases + [dict(row_weight=row_weight)]:

        def old(hn, w, kw=kw):
            kw = dict(kw)
            rw = kw.pop("row_weight", None)
            if rw is not None:  # draft_loss has no row weights: the same sum by hand
                kl = forward_kl(hn @ w, t, rows)
                out = draft_loss(hn @ w, t, LossRows(mask, depth, num_depths=4, teacher_rows=rows))
                return jnp.sum(kl * rw * mask), out
            out = draft_loss(hn @ w, t, LossRows(mask, depth, num_depths=4, teacher_rows=rows, **kw))
            return out.loss, out

        def new(hn, w, kw=kw):
            out = fused_draft_loss(hn, w, t, LossRows(mask, depth, num_depths=4, teacher_rows=rows, **kw), chunk=64)
            return out.loss, out

        (la, a), ga = jax.value_and_grad(old, argnums=(0, 1), has_aux=True)(hn, w)
        (lb, f), gb = jax.jit(jax.value_and_grad(new, argnums=(0, 1), has_aux=True))(hn, w)
        np.testing.assert_allclose(float(lb), float(la), rtol=1e-5)
        np.testing.assert_allclose(float(f.loss_sum), float(a.loss_sum), rtol=1e-5)
        for x, y in zip(gb, ga):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(y))))
        np.testing.assert_array_equal(np.asarray(f.correct), np.asarray(a.correct))
        np.testing.assert_array_equal(np.asarray(f.total), np.asarray(a.total))
        # hits of the supervised rows; the others are never multiplied by the vocabulary
        np.testing.assert_array_equal(np.asarray(f.hit), np.asarray(a.hit & mask))
    assert int(np.asarray(a.hit & mask)[0].sum()) >= 25  # hits and misses both compared
    # the kernel's gradient only when it is differentiated; evaluation (no gradient) the same loss
    g_states = jax.jit(jax.grad(lambda hn: new(hn, w)[0]))(hn)
    np.testing.assert_allclose(
        np.asarray(g_states), np.asarray(gb[0]), rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(gb[0])))
    )
    np.testing.assert_allclose(float(jax.jit(new)(hn, w)[0]), float(lb), rtol=1e-6)


def test_ce_weight_mixes_forward_kl_and_cross_entropy_on_the_teacher_top():
    """`fused_draft_loss(ce_weight=w)` (the loss target of `loss_target`) equals
    sum_rows mask ((1 - w) KL + w CE(top)) / rows written out with log-softmaxes, value and
    gradients, for w = 0, 0.3 and 1; a teacher with ties keeps its first top token (CE's label)."""
    rng = np.random.default_rng(11)
    b, n, h, vd, positions = 2, 90, 12, 40, 50
    hn = jnp.asarray(rng.standard_normal((b, n, h)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((h, vd)), jnp.float32)
    t = 2 * rng.standard_normal((b, positions, vd)).astype(np.float32)
    t[0, 3, 5] = t[0, 3, 9] = t[0, 3].max() + 1.0  # a tie: the label is id 5
    t = jnp.asarray(t)
    rows = jnp.asarray(rng.integers(0, positions, (b, n)), jnp.int32)
    mask = jnp.asarray(rng.random((b, n)) < 0.7)

    def written_out(hn, w, ce_weight):
        logq = jax.nn.log_softmax(hn @ w, axis=-1)
        logp = take_rows(jax.nn.log_softmax(t, axis=-1), rows)
        kl = jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
        label = take_rows(jnp.argmax(t, axis=-1), rows)
        ce = -jnp.take_along_axis(logq, label[..., None], axis=-1)[..., 0]
        per_row = (1.0 - ce_weight) * kl + ce_weight * ce
        return jnp.sum(per_row * mask) / (jnp.sum(mask) + 1e-5)

    values = []
    for ce_weight in (0.0, 0.3, 1.0):

        def fused(hn, w, ce_weight=ce_weight):
            return fused_draft_loss(hn, w, t, LossRows(mask, teacher_rows=rows), chunk=32, ce_weight=ce_weight).loss

        la, ga = jax.value_and_grad(written_out, argnums=(0, 1))(hn, w, ce_weight)
        lb, gb = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(hn, w)
        np.testing.assert_allclose(float(lb), float(la), rtol=1e-5)
        for x, y in zip(gb, ga):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(y))))
        values.append(float(lb))
    assert len({round(v, 4) for v in values}) == 3  # three different losses: the weight is used
