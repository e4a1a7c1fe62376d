"""Block schedules vs the dense mask: they cover every non-empty block, mark only truly
full blocks, and (for sorted COD layouts) are exactly the non-empty blocks."""

import jax
import numpy as np
import pytest

from kernels import AttentionSpec
from kernels.layouts import cod_layout, pad_layout
from kernels.schedule import flat_ids, make_schedule


def _dense_blocks(spec, bq, bk):
    m = np.asarray(spec.dense_mask())
    B, Tq, Tk = m.shape
    nq, nk = -(-Tq // bq), -(-Tk // bk)
    mp = np.zeros((B, nq * bq, nk * bk), bool)
    mp[:, :Tq, :Tk] = m
    full = np.ones((B, nq * bq, nk * bk), bool)
    full[:, :Tq, :Tk] = m
    full[:, Tq:, :] = False
    full[:, :, Tk:] = False
    return (mp.reshape(B, nq, bq, nk, bk).any((2, 4)), full.reshape(B, nq, bq, nk, bk).all((2, 4)))


_flat_ids = jax.jit(flat_ids, static_argnums=2)
_make_schedule = jax.jit(make_schedule, static_argnums=(1, 2, 3))


def _visited(ranges, count, n):
    ids = np.asarray(_flat_ids(ranges, count, n))
    count = np.asarray(count)
    out = np.zeros(ids.shape[:2] + (n,), bool)
    for b in range(ids.shape[0]):
        for i in range(ids.shape[1]):
            sel = ids[b, i, : count[b, i]]
            assert len(set(sel.tolist())) == len(sel)  # each block visited once
            out[b, i, sel] = True
    return out


def _full_marks(full, n):
    full = np.asarray(full)
    out = np.zeros(full.shape[:2] + (n,), bool)
    for b in range(full.shape[0]):
        for i in range(full.shape[1]):
            out[b, i, full[b, i, 0] : full[b, i, 1]] = True
    return out


def _check(spec, bq, bk, num_ranges=16, exact=True):
    sched = _make_schedule(spec, bq, bk, num_ranges)
    nonempty, full = _dense_blocks(spec, bq, bk)
    nq, nk = nonempty.shape[1:]
    fwd = _visited(sched.fwd_ranges, sched.fwd_count, nk)
    bwd = _visited(sched.bwd_ranges, sched.bwd_count, nq)
    assert np.all(fwd >= nonempty), "forward schedule misses a non-empty block"
    assert np.all(bwd >= nonempty.transpose(0, 2, 1)), "dK/dV schedule misses a block"
    if num_ranges >= 16:  # no merged runs: the transposed schedule is the transpose
        np.testing.assert_array_equal(bwd, fwd.transpose(0, 2, 1))
    fwd_full = _full_marks(sched.fwd_full, nk)
    bwd_full = _full_marks(sched.bwd_full, nq)
    assert np.all(full >= fwd_full)
    assert np.all(full.transpose(0, 2, 1) >= bwd_full)
    assert np.all(fwd >= fwd_full)
    if exact:
        np.testing.assert_array_equal(fwd, nonempty)
    skipped = float(sched.skipped_fraction())
    np.testing.assert_allclose(skipped, 1 - fwd.mean(), rtol=1e-6)
    return fwd, nonempty, full, fwd_full


@pytest.mark.parametrize(
    "K,r,docs,window,bq,bk", [(8, 0.7, None, None, 32, 16), (4, 0.5, 3, None, 64, 32), (6, 0.8, 2, 40, 32, 32)]
)
def test_schedule_is_exact_on_sorted_cod_layouts(K, r, docs, window, bq, bk):
    rng = np.random.default_rng(K)
    rows = [cod_layout(300, K, r=r, rng=rng, docs=docs), cod_layout(250, K, r=r, rng=rng)]
    T = max(len(x[0]) for x in rows) + 9  # padding rows, odd length
    a, d, c = (np.stack(x) for x in zip(*[pad_layout(*row, T) for row in rows]))
    spec = AttentionSpec.peagle(a, d, c, sliding_window=window)
    fwd, nonempty, full, fwd_full = _check(spec, bq, bk)
    assert 0.5 < 1 - fwd.mean() < 0.95  # most blocks are skipped
    if window is None:  # the full-block marks find every full block: one causal run per row
        np.testing.assert_array_equal(fwd_full, full)


def test_schedule_with_loss_mask_gaps_and_causal():
    rng = np.random.default_rng(0)
    lm = rng.random(400) < 0.6
    a, d, c = cod_layout(400, 8, rng=rng, docs=4, loss_mask=lm)
    fwd, nonempty, _, _ = _check(AttentionSpec.peagle(a, d, c), 32, 32, exact=False)
    assert fwd.sum() <= 1.1 * nonempty.sum()  # nearly tight
    pos = np.arange(500)[None]
    doc = (pos >= 200).astype(np.int32)
    _check(AttentionSpec.causal(pos[:, 300:], pos, q_doc=doc[:, 300:], kv_doc=doc, sliding_window=100), 32, 64)


def test_schedule_correct_for_unsorted_rows_and_few_ranges():
    rng = np.random.default_rng(1)
    a, d, c = cod_layout(200, 6, rng=rng, docs=2)
    perm = rng.permutation(len(a))
    spec = AttentionSpec.peagle(a[perm], d[perm], c[perm])
    _check(spec, 32, 32, exact=False)  # covers, less sparse
    a, d, c = cod_layout(300, 8, rng=rng)
    _check(AttentionSpec.peagle(a, d, c), 16, 16, num_ranges=2, exact=False)  # runs merged


def test_sorted_cod_needs_at_most_2k_minus_1_ranges():
    K = 8
    a, d, c = cod_layout(1000, K, rng=3, docs=2)
    spec = AttentionSpec.peagle(a, d, c)
    nonempty, _ = _dense_blocks(spec, 64, 64)
    starts = nonempty & ~np.concatenate([np.zeros_like(nonempty[..., :1]), nonempty[..., :-1]], axis=-1)
    assert starts.sum(-1).max() <= 2 * K - 1
