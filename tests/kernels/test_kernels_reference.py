"""The dense reference (the truth for kernel tests), AttentionSpec and COD layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from kernels import AttentionSpec
from kernels.layouts import cod_layout, pad_layout


def _naive(q, k, v, a, d, c, window=None, softcap=None, sinks=None, scale=None):
    """Row-by-row numpy attention with the rule written out literally."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    scale = scale or 1 / np.sqrt(D)
    out = np.zeros_like(q)
    lse = np.full((B, Hq, T), -np.inf)
    for b in range(B):
        for t in range(T):
            keys = []
            for s in range(T):
                if c[b, t] < 0 or c[b, s] < 0 or c[b, t] != c[b, s]:
                    continue
                in_window = window is None or a[b, t] + d[b, t] - a[b, s] < window  # from the reference position
                if not (
                    (d[b, s] == 0 and a[b, s] <= a[b, t] and in_window) or (a[b, s] == a[b, t] and d[b, s] <= d[b, t])
                ):
                    continue
                keys.append(s)
            for h in range(Hq):
                sc = np.array([q[b, t, h] @ k[b, s, h // G] * scale for s in keys])
                if softcap is not None and len(keys):
                    sc = softcap * np.tanh(sc / softcap)
                terms = list(sc) + ([sinks[h]] if sinks is not None else [])
                if not terms:
                    continue
                m = max(terms)
                z = sum(np.exp(x - m) for x in terms)
                lse[b, h, t] = m + np.log(z)
                for s, x in zip(keys, sc):
                    out[b, t, h] += np.exp(x - lse[b, h, t]) * v[b, s, h // G]
    return out, lse


@pytest.mark.parametrize("window,softcap,with_sinks", [(None, None, False), (5, 3.0, True)])
def test_reference_matches_naive_rule(window, softcap, with_sinks):
    rng = np.random.default_rng(0)
    rows = [cod_layout(8, 4, rng=rng, docs=2), cod_layout(7, 3, r=0.9, rng=rng)]
    T = max(len(r[0]) for r in rows) + 2
    a, d, c = (np.stack(x) for x in zip(*[pad_layout(*r, T) for r in rows]))
    B, Hq, Hkv, D = 2, 4, 2, 8
    q = rng.normal(size=(B, T, Hq, D)).astype(np.float32)
    k = rng.normal(size=(B, T, Hkv, D)).astype(np.float32)
    v = rng.normal(size=(B, T, Hkv, D)).astype(np.float32)
    sinks = rng.normal(size=Hq).astype(np.float32) if with_sinks else None
    spec = AttentionSpec.peagle(a, d, c, sliding_window=window, softcap=softcap)
    out, lse = kernels.reference.attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), spec, sinks=sinks)
    want_out, want_lse = _naive(q, k, v, a, d, c, window, softcap, sinks)
    np.testing.assert_allclose(np.asarray(out), want_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=1e-5, rtol=1e-5)
    if not with_sinks:  # padding rows: out 0, lse -inf
        pad = c < 0
        assert np.all(np.asarray(out)[pad] == 0)
        assert np.all(np.isneginf(np.asarray(lse).transpose(0, 2, 1)[pad]))


def test_reference_gradients_finite_and_zero_on_masked_rows():
    a, d, c = pad_layout(*cod_layout(6, 3, rng=1), 16)
    spec = AttentionSpec.peagle(a, d, c)
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 16, 2, 8))
    k = jax.random.normal(jax.random.PRNGKey(1), (1, 16, 1, 8)) * 30  # large scores
    g = jax.grad(lambda q, k, v: jnp.sum(kernels.reference.attention(q, k, v, spec)[0] ** 2), argnums=(0, 1, 2))(
        q, k, k
    )
    for x in g:
        assert np.all(np.isfinite(np.asarray(x)))
    assert np.all(np.asarray(g[0])[0, c < 0] == 0)


def test_spec_pytree_and_constructors():
    pos = jnp.arange(10)[None]
    doc = jnp.array([[0] * 4 + [1] * 5 + [-1]])
    causal = AttentionSpec.causal(pos, q_doc=doc, sliding_window=3)
    peagle = AttentionSpec.peagle(pos, jnp.zeros_like(pos), doc, sliding_window=3)
    np.testing.assert_array_equal(causal.dense_mask(), peagle.dense_mask())
    leaves, tree = jax.tree_util.tree_flatten(causal)
    assert len(leaves) == 6
    assert all(x.dtype == jnp.int32 for x in leaves)
    m = jax.jit(lambda s: s.dense_mask())(causal)  # static fields survive jit
    np.testing.assert_array_equal(m, causal.dense_mask())
    mk = np.asarray(m[0])
    assert mk[3, 0] == False  # noqa: E712
    assert mk[3, 1]
    assert mk[4, 3] == False  # noqa: E712
    assert not mk[9].any()
    valid = AttentionSpec.causal(pos, q_valid=jnp.arange(10)[None] < 7)
    assert not np.asarray(valid.dense_mask())[0, 8].any()
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionSpec.causal(pos, sliding_window=0)
    with pytest.raises(ValueError, match="integer"):
        AttentionSpec.peagle(pos.astype(jnp.float32), pos, pos)


def test_cod_layout_follows_the_cod_algorithm():
    n, K, r, r_min = 200, 8, 0.7, 0.2
    a, d, c = cod_layout(n, K, r=r, r_min=r_min, rng=0, docs=3)
    order = np.lexsort((a, d))
    np.testing.assert_array_equal(order, np.arange(len(a)))  # sorted by (depth, anchor)
    assert np.array_equal(a[d == 0], np.arange(n))  # one depth-0 row per position
    doc_of = c[d == 0]
    assert np.all(np.diff(doc_of) >= 0)  # contiguous documents
    rows = set(zip(a.tolist(), d.tolist()))
    for ai, di in rows:  # nested: the chain exists
        assert all((ai, e) in rows for e in range(di))
        assert doc_of[ai] == doc_of[min(ai + di, n - 1)]  # reference pos in the doc
    for dv in np.unique(doc_of):  # per-document sizes
        n_valid = int(np.sum(doc_of == dv))
        for depth in range(1, K):
            want = int(max(0, n_valid - depth) * max(r**depth, r_min))
            got = int(np.sum((d == depth) & (c == dv)))
            assert got <= want
            assert got == want or depth > 1
    lm = np.random.default_rng(1).random(n) < 0.5
    a2, d2, _ = cod_layout(n, K, rng=0, loss_mask=lm)
    assert np.all(lm[(a2 + d2)[d2 > 0]])  # deeper rows supervised
