"""COD sampling (kernels.layouts.cod_sample, the one sampler) and the trainer's batches."""

from __future__ import annotations

import numpy as np
import pytest

from kernels.layouts import cod_layout, cod_sample
from train import cod
from train.data import Example
from train.spec import BatchSpec


def _mask(n, seed):
    rng = np.random.default_rng(seed)
    m = rng.random(n) < 0.7
    m[: n // 5] = False  # a prompt
    return m


@pytest.mark.parametrize("seed", range(5))
def test_chains_are_nested_and_anchors_valid(seed):
    n, k = 120, 8
    sup = _mask(n, seed)
    doc = np.zeros(n, np.int32)
    doc[n - 7 :] = -1  # padding tail
    anchor, depth = cod_sample(sup, doc, k, 0.7, 0.2, seed)
    assert anchor.min() >= 0
    rows = set(zip(anchor.tolist(), depth.tolist()))
    assert all((a, 0) in rows for a in range(n))
    for a, d in rows:
        if d:
            assert (a, d - 1) in rows, (a, d)  # nested
            assert sup[a + d]  # every deeper row is supervised
            assert doc[a + d] == doc[a] >= 0
    # sorted by (depth, anchor)
    assert np.all(np.diff(depth * 10_000 + anchor) > 0)


def test_sizes_per_depth_follow_the_formula():
    n, k, r, r_min = 200, 8, 0.7, 0.2
    sup = np.ones(n, bool)
    anchor, depth = cod_sample(sup, np.zeros(n, np.int32), k, r, r_min, 0)
    valid = n
    pool = n - 1  # position 0 is never a deeper row's reference
    for d in range(1, k):
        size = int(max(0, valid - d) * max(r**d, r_min))
        got = int((depth == d).sum())
        assert got == min(size, pool), (d, got, size, pool)
        pool = got - int((anchor[depth == d] + d == n - 1).sum())


def test_seeded_and_reproducible():
    sup = _mask(80, 1)
    doc = np.zeros(80, np.int32)
    a1 = cod_sample(sup, doc, 6, rng=3)
    a2 = cod_sample(sup, doc, 6, rng=3)
    a3 = cod_sample(sup, doc, 6, rng=4)
    np.testing.assert_array_equal(a1[0], a2[0])
    assert not np.array_equal(a1[0], a3[0])
    # cod_layout (kernel tests) is the same sampler
    l1 = cod_layout(80, 6, rng=3, loss_mask=sup)
    np.testing.assert_array_equal(l1[0], a1[0])
    np.testing.assert_array_equal(l1[1], a1[1])


def test_documents_never_cross():
    n = 60
    doc = np.repeat(np.arange(3), 20).astype(np.int32)
    anchor, depth = cod_sample(np.ones(n, bool), doc, 8, rng=0)
    assert np.all(doc[anchor] == doc[np.minimum(anchor + depth, n - 1)])
    assert not np.any((depth > 0) & np.isin(anchor + depth, [0, 20, 40]))


def _example(n, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 50, n).astype(np.int32)
    mask = np.zeros(n, bool)
    mask[n // 3 :] = True
    return Example(ids, mask, seed)


def test_batch_rows_outside_the_loss_mask_are_never_supervised():
    exs = [_example(40, 0), _example(23, 1)]
    spec = BatchSpec(
        mode="parallel", k=5, max_len=64, r=0.7, r_min=0.2, row_factor=3.0, length_buckets=1, row_granularity=0
    )
    b = cod.make_batch(exs, spec, step=3)
    assert b.tokens.shape == (2, 64)
    assert b.anchor.shape == (2, 192)
    for i, e in enumerate(exs):
        n = len(e.ids)
        # row t predicts token t + 2: supervised iff that token is an assistant token
        want = np.zeros(64, bool)
        want[: n - 2] = e.mask[2:]
        np.testing.assert_array_equal(b.sup[i], want)
        real = b.doc[i] >= 0
        ref = b.anchor[i] + b.depth[i]
        assert np.all(ref[real] <= n - 2)  # every real row has a token and a teacher
        assert np.all(b.sup[i][ref[real & (b.depth[i] > 0)]])
        assert np.all(b.anchor[i] >= 0)
    again = cod.make_batch(exs, spec, step=3)
    np.testing.assert_array_equal(again.anchor, b.anchor)


def test_row_cut_keeps_chains_nested():
    e = _example(64, 2)
    e.mask[:] = True
    b = cod.make_batch(
        [e],
        BatchSpec(
            mode="parallel", k=8, max_len=64, r=0.9, r_min=0.5, row_factor=1.5, length_buckets=1, row_granularity=0
        ),
        step=0,
    )
    real = b.doc[0] >= 0
    rows = set(zip(b.anchor[0][real].tolist(), b.depth[0][real].tolist()))
    assert len(rows) == 95  # 96 rows, the last depth-0 row (t = n - 1) is padding
    assert all(d == 0 or (a, d - 1) in rows for a, d in rows)


def test_chain_rows_cover_every_step():
    doc = np.array([0] * 10 + [-1] * 6, np.int32)
    a, d, c = cod.chain_rows(doc, 3)
    assert len(a) == 48
    ok = c >= 0
    assert np.all(a[ok] + d[ok] <= 9)
    assert ok.sum() == 10 + 9 + 8
