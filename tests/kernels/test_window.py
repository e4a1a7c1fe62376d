"""The sliding window in the P-EAGLE rule: a row sees the depth-0 rows within the window of its
reference position (anchor + depth) and its own chain. The dense rule, the block schedules (a
block inside the causal range may be partly outside the window) and the blockwise kernels
against a mask built here, row by row, as speculators' `create_peagle_mask_mod` writes it."""

import jax
import numpy as np
import pytest

from kernels import AttentionSpec, make_schedule
from kernels import cases as kt
from kernels.layouts import cod_layout, pad_layout


def rule_mask(a, d, c, window):
    """[B, T, T]: query i sees key j (same document, neither padding) when j is a depth-0 row with
    a_j <= a_i and a_j > a_i + d_i - window, or j is in i's chain (a_j == a_i, d_j <= d_i)."""
    aq, dq, cq = (np.asarray(x)[:, :, None] for x in (a, d, c))
    ak, dk, ck = (np.asarray(x)[:, None, :] for x in (a, d, c))
    near = True if window is None else ak > aq + dq - window
    return (cq >= 0) & (ck == cq) & (((dk == 0) & (ak <= aq) & near) | ((ak == aq) & (dk <= dq)))


def layouts(seed=0):
    """Two packed rows of COD layouts, several documents, padding rows at the end."""
    rng = np.random.default_rng(seed)
    rows = [cod_layout(48, 6, r=0.8, rng=rng, docs=3), cod_layout(40, 4, rng=rng, docs=2)]
    T = max(len(x[0]) for x in rows) + 5
    return tuple(np.stack(x) for x in zip(*[pad_layout(*row, T) for row in rows]))


@pytest.mark.parametrize("window", [1, 2, 5, 17, None])
def test_rule_matches_a_mask_built_from_the_rule(window):
    a, d, c = layouts()
    got = np.asarray(AttentionSpec.peagle(a, d, c, sliding_window=window).dense_mask())
    want = rule_mask(a, d, c, window)
    np.testing.assert_array_equal(got, want)
    if window is not None:  # the window hides something, but never a row's own chain
        assert (want < rule_mask(a, d, c, None)).any()
        chain = (a[:, :, None] == a[:, None, :]) & (d[:, None, :] <= d[:, :, None]) & (c[:, :, None] >= 0)
        chain &= c[:, :, None] == c[:, None, :]
        assert got[chain].all()
    if window == 1:  # depth-0 rows see themselves only; deeper rows their chain only
        np.testing.assert_array_equal(got, (a[:, :, None] == a[:, None, :]) & want)


def test_window_at_least_the_length_is_no_window():
    a, d, c = cod_layout(40, 5, rng=1)  # one document: positions 0..39
    full = np.asarray(AttentionSpec.peagle(a, d, c).dense_mask())
    for window in (40, 41, 1000):
        np.testing.assert_array_equal(
            np.asarray(AttentionSpec.peagle(a, d, c, sliding_window=window).dense_mask()), full
        )
    # one less and the longest reach (the row at position 39 to the row at 0) is cut
    cut = np.asarray(AttentionSpec.peagle(a, d, c, sliding_window=39).dense_mask())
    np.testing.assert_array_equal(cut, rule_mask(a[None], d[None], c[None], 39))
    assert (cut < full).sum() >= 1


def test_causal_rows_get_the_positional_window():
    pos = np.arange(30)[None]
    m = np.asarray(AttentionSpec.causal(pos, sliding_window=4).dense_mask())[0]
    i, j = np.meshgrid(np.arange(30), np.arange(30), indexing="ij")
    np.testing.assert_array_equal(m, (j <= i) & (i - j < 4))


_make_schedule = jax.jit(make_schedule, static_argnums=(1, 2))


def _blocks(mask, bq, bk):
    B, Tq, Tk = mask.shape
    nq, nk = -(-Tq // bq), -(-Tk // bk)
    pad = np.zeros((B, nq * bq, nk * bk), bool)
    pad[:, :Tq, :Tk] = mask
    full = np.zeros_like(pad)
    full[:, :Tq, :Tk] = mask
    blocks = pad.reshape(B, nq, bq, nk, bk)
    return blocks.any((2, 4)), full.reshape(B, nq, bq, nk, bk).all((2, 4))


def _marks(ranges, count, full, n):
    ranges, count, full = (np.asarray(x) for x in (ranges, count, full))
    visit = np.zeros(count.shape + (n,), bool)
    marked = np.zeros_like(visit)
    for idx in np.ndindex(count.shape):
        for s, e in ranges[idx]:
            visit[idx + (slice(s, e),)] = True
        marked[idx + (slice(full[idx][0], full[idx][1]),)] = True
    return visit, marked


@pytest.mark.parametrize("window,bq,bk", [(1, 16, 8), (40, 8, 8)])
def test_schedule_covers_the_window_and_marks_only_full_blocks(window, bq, bk):
    rng = np.random.default_rng(window)
    rows = [cod_layout(120, 5, rng=rng, docs=2), cod_layout(100, 7, r=0.8, rng=rng)]
    T = max(len(x[0]) for x in rows) + 3
    a, d, c = (np.stack(x) for x in zip(*[pad_layout(*row, T) for row in rows]))
    mask = rule_mask(a, d, c, window)
    nonempty, full = _blocks(mask, bq, bk)
    sched = _make_schedule(AttentionSpec.peagle(a, d, c, sliding_window=window), bq, bk)
    visit, marked = _marks(sched.fwd_ranges, sched.fwd_count, sched.fwd_full, nonempty.shape[2])
    assert np.all(visit >= nonempty), "a block with a visible pair is skipped"
    assert np.all(full >= marked), "a block marked full has a hidden pair"
    assert visit.sum() <= 1.2 * nonempty.sum()  # still sparse: the window skips blocks too
    # blocks wholly inside the causal range but partly outside the window exist (not marked full)
    causal_full = _blocks(rule_mask(a, d, c, None), bq, bk)[1]
    assert (causal_full & ~full).any()
    assert marked.any() == (window > bq + bk)  # with room for whole blocks inside the window, they skip the mask
    bwd_visit = _marks(sched.bwd_ranges, sched.bwd_count, sched.bwd_full, nonempty.shape[1])[0]
    assert np.all(bwd_visit >= nonempty.transpose(0, 2, 1))


CASE = kt.Case(
    "cod_gqa2_window3_sinks",
    hq=4,
    hkv=2,
    d=32,
    layouts=((44, 6, 0.8, 3, None), (30, 4, 0.7, 1, 0.8)),
    window=3,
    sinks=True,
)


def test_blockwise_kernel_matches_the_reference_with_a_window():
    """Forward, lse and gradients of the blockwise XLA path (16-row blocks: many partial and
    skipped blocks) against the dense reference, whose mask is the rule above. Every backend
    evaluates the same `kernels.visible` inside its blocks; the schedule decides which blocks
    they visit and which skip the mask."""
    q, k, v, spec, sinks = kt.make_case(CASE)
    meta = [np.asarray(x) for x in spec.q_meta]
    np.testing.assert_array_equal(np.asarray(spec.dense_mask()), rule_mask(*meta, CASE.window))
    assert (rule_mask(*meta, CASE.window) < rule_mask(*meta, None)).any()  # the window hides keys here
    kt.assert_backend_matches_reference(CASE, "xla", block_q=16, block_k=16)
