"""`kernels.slot_attention` equals the P-EAGLE rule over the rows it stands for (the dense
reference of rows built from the per-position and slot inputs), values and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from kernels.layouts import cod_layout, pad_layout
from kernels.mask_slot import check_layout, slot_attention

HQ, HKV, D = 4, 2, 16


def rows_of(per_position, slot, anchor, depth, doc):
    """[B, N, ...]: a depth-0 row reads per_position at its anchor, a deeper row slot at anchor + depth."""
    deep = (depth >= 1) & (doc >= 0)
    idx = jnp.where(deep, anchor + depth, anchor)
    b = per_position.shape[0]
    mine = per_position[jnp.arange(b)[:, None], jnp.clip(idx, 0, per_position.shape[1] - 1)]
    theirs = slot[jnp.arange(b)[:, None], jnp.clip(idx, 0, slot.shape[1] - 1)]
    return jnp.where(deep[..., None, None], theirs, mine)


def layout(length, k, docs, seed, pad=0, loss=None):
    rng = np.random.default_rng(seed)
    a, d, c = cod_layout(length, k, rng=rng, docs=docs, loss_mask=loss)
    if pad:
        a, d, c = pad_layout(a, d, c, len(a) + pad)
    order = rng.permutation(len(a))  # any row order
    return tuple(jnp.asarray(x[order])[None] for x in (a, d, c))


def inputs(length, seed):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    return (
        f(1, length, HQ, D),
        f(1, length, HKV, D),
        f(1, length, HKV, D),
        f(1, length, HQ, D),
        f(1, length, HKV, D),
        f(1, 1, HKV, D),
    )


CASES = [
    # length, K, docs, window, softcap, sinks, padding rows, prompt (unsupervised first positions)
    (64, 8, 3, None, None, False, 5, 0),
    (57, 5, 4, 6, None, False, 0, 0),
    (48, 8, 2, 3, 20.0, False, 3, 0),  # a window <= W + 1: no base keys at all
    (33, 4, 2, None, None, True, 2, 0),
    (80, 8, None, None, None, False, 0, 40),  # whole query blocks of the base part skipped
]


BACKENDS = {  # the block part on each backend (Pallas interpreted on CPU)
    "xla": dict(backend="xla", block_q=16, block_k=16),
    "gpu": dict(backend="gpu", block_q=16, block_k=16, interpret=True),
    "tpu": dict(backend="tpu", interpret="generic"),
}


@pytest.mark.parametrize(
    "length,k,docs,window,softcap,sinks,pad,prompt,backend",
    [(*c, "xla") for c in CASES] + [(*CASES[0], "gpu"), (*CASES[0], "tpu")],
)
def test_slot_attention_is_the_peagle_rule_over_its_rows(length, k, docs, window, softcap, sinks, pad, prompt, backend):
    anchor, depth, doc = layout(length, k, docs, seed=length, pad=pad, loss=np.arange(length) >= prompt)
    check_layout(anchor, depth, doc, length, k - 1)
    spec = kernels.AttentionSpec.peagle(anchor, depth, doc, chain_depth=k - 1, sliding_window=window, softcap=softcap)
    args = inputs(length, seed=length + 1)
    sink = jnp.asarray(np.linspace(-1, 1, HQ), jnp.float32) if sinks else None
    w = jnp.asarray(np.random.default_rng(0).normal(size=(1, anchor.shape[1], HQ, D)), jnp.float32)

    def ours(q0, k0, v0, qs, ks, vs):
        out = slot_attention(q0, k0, v0, qs, ks, vs, spec, sinks=sink, **BACKENDS[backend])
        return jnp.sum(out * w), out

    def reference(q0, k0, v0, qs, ks, vs):
        q, kk = rows_of(q0, qs, *spec.q_meta), rows_of(k0, ks, *spec.q_meta)
        v = rows_of(v0, jnp.broadcast_to(vs, v0.shape), *spec.q_meta)
        out, _ = kernels.reference.attention(q, kk, v, spec, sinks=sink)
        return jnp.sum(out * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(ours, argnums=range(6), has_aux=True))(*args)
    (_, ref), ref_grads = jax.jit(jax.value_and_grad(reference, argnums=range(6), has_aux=True))(*args)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
    for name, g, r in zip(("q0", "k0", "v0", "q_slot", "k_slot", "v_slot"), grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=5e-5, rtol=5e-5, err_msg=name)


def test_slot_attention_rows_deeper_than_chain_depth_would_be_wrong():
    anchor, depth, doc = layout(32, 6, None, seed=3)
    with pytest.raises(ValueError, match="needs depth <= 3"):
        check_layout(anchor, depth, doc, 32, 3)
    with pytest.raises(ValueError, match="chain_depth >= 1"):
        slot_attention(*inputs(32, 0), kernels.AttentionSpec.peagle(anchor, depth, doc))


def test_check_layout_names_the_broken_row():
    a, d, c = (np.asarray(x[0]) for x in layout(24, 4, 2, seed=1))
    check_layout(a, d, c, 24, 3)
    j = int(np.nonzero(d == 2)[0][0])
    gone = np.nonzero((a == a[j]) & (d == 1))[0][0]  # drop the middle of a chain
    c2 = c.copy()
    c2[gone] = -1
    with pytest.raises(ValueError, match=f"COD row {j}: .* lacks a row of its chain"):
        check_layout(a, d, c2, 24, 3)
    c3 = c.copy()
    c3[(d == 0) & (a == 5)] = 7  # a document interrupted by another
    with pytest.raises(ValueError, match="not one contiguous position range|lacks a row"):
        check_layout(a, d, c3, 24, 3)
    dup = (np.concatenate([a, a[j : j + 1]]), np.concatenate([d, d[j : j + 1]]), np.concatenate([c, c[j : j + 1]]))
    with pytest.raises(ValueError, match="share an"):
        check_layout(*dup, 24, 3)
