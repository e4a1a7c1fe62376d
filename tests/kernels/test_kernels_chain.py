"""`AttentionSpec.chain_depth`: chain keys gathered outside the block loop (`kernels.chain`).

The same attention as the reference for any chain_depth: chains deeper than it (their deeper
keys stay in the block loop), duplicate (anchor, depth) keys of per-document positions (kept in
the block loop), windows, softcap, sinks, padding rows, bf16; and the block loop really skips
the chain blocks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from kernels import cases as kt
from kernels import chain
from kernels.layouts import cod_layout, cod_sample, pad_layout
from kernels.schedule import build_schedule, pad_rows

BLOCKS = dict(block_q=32, block_k=16)
CASES = [
    dataclasses.replace(kt.CASE_COD_F32, chain_depth=7),  # every chain gathered (K 4 and 8), sinks
    dataclasses.replace(kt.CASE_COD_BF16, chain_depth=3),  # window, softcap, bf16; depths 4, 5 stay in the loop
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.name}_chain{c.chain_depth}")
def test_chain_gather_matches_reference(case):
    kt.assert_backend_matches_reference(case, "xla", **BLOCKS)


def test_chain_gather_pallas_gpu_interpret():
    kt.assert_backend_matches_reference(CASES[0], "gpu", interpret=True, block_q=16, block_k=16)


def _layout(n=60, K=6, docs=3, seed=0, per_doc_positions=False):
    a, d, c = cod_layout(n, K, rng=np.random.default_rng(seed), docs=docs)
    if per_doc_positions:  # anchors restart in each document: (anchor, depth) repeats across documents
        start = {int(x): int(a[(c == x) & (d == 0)].min()) for x in np.unique(c)}
        a = a - np.array([start[int(x)] for x in c], np.int32)
    return pad_layout(a, d, c, len(a) + 5)


def test_split_gathers_each_chain_once():
    a, d, c = _layout()
    spec = kernels.AttentionSpec.peagle(a, d, c, chain_depth=3)
    block_spec, idx, found = chain.split(spec)
    gathered = np.asarray(block_spec.kv_doc[0] < 0) & (c >= 0)
    np.testing.assert_array_equal(gathered, (d >= 1) & (d <= 3) & (c >= 0))
    idx, found = np.asarray(idx[0]), np.asarray(found[0])
    np.testing.assert_array_equal(found.sum(1), np.where(c >= 0, np.minimum(d, 3), 0))
    for i in np.nonzero(c >= 0)[0]:  # the found keys are the query's own chain, depth w at column w - 1
        for w in np.nonzero(found[i])[0]:
            j = idx[i, w]
            assert (a[j], d[j], c[j]) == (a[i], w + 1, c[i])


def test_duplicate_keys_stay_in_the_block_loop():
    a, d, c = _layout(per_doc_positions=True, seed=2)
    spec = kernels.AttentionSpec.peagle(a, d, c, chain_depth=5)
    block_spec, _, found = chain.split(spec)
    keys = {}
    for x in zip(a[d >= 1], d[d >= 1]):
        keys[x] = keys.get(x, 0) + 1
    dup = np.array([keys.get((x, y), 0) > 1 for x, y in zip(a, d)])
    assert dup.any(), "the layout must repeat an (anchor, depth) across documents"
    np.testing.assert_array_equal(np.asarray(block_spec.kv_doc[0]) < 0, (c < 0) | ((d >= 1) & ~dup))
    q, k, v = (
        jnp.asarray(np.random.default_rng(i).standard_normal((1, len(a), h, 32)), jnp.float32)
        for i, h in ((0, 4), (1, 2), (2, 2))
    )
    do, dlse = kt.cotangents(q)
    want = kt.fwd_bwd_fn("reference", False, None, None, False)(q, k, v, spec, None, do, dlse)
    got = kt.fwd_bwd_fn("xla", False, 32, 16, False)(q, k, v, spec, None, do, dlse)
    for x, y in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):
        assert kt.rel_err(x, y) <= 2e-5


def test_block_loop_skips_the_chain_blocks():
    a, d, c = cod_layout(512, 8, rng=0)

    def visited(spec):
        meta = [pad_rows(x, 128, v) for x, v in zip((*spec.q_meta, *spec.kv_meta), (0, 0, -1) * 2)]
        return int(build_schedule(tuple(meta[:3]), tuple(meta[3:]), 128, 128, None, 16).fwd_count.sum())

    full = kernels.AttentionSpec.peagle(a, d, c)
    block_spec, _, _ = chain.split(dataclasses.replace(full, chain_depth=7))
    assert visited(block_spec) * 2 <= visited(full)  # 46 of 98 block pairs at 512 tokens, K 8


def test_sort_queries_orders_by_doc_anchor_depth_padding_last():
    a, d, c = _layout(n=80, K=5, docs=3, seed=4)
    rng = np.random.default_rng(1)
    shuffle = rng.permutation(len(a))  # any layout: the order must come from the metadata alone
    a, d, c = a[shuffle], d[shuffle], c[shuffle]
    spec = kernels.AttentionSpec.peagle(a, d, c, chain_depth=4)
    sorted_spec, order, inverse = chain.sort_queries(spec)
    order, inverse = np.asarray(order[0]), np.asarray(inverse[0])
    np.testing.assert_array_equal(np.sort(order), np.arange(len(a)))
    np.testing.assert_array_equal(order[inverse], np.arange(len(a)))
    real = c[order] >= 0
    assert real[: real.sum()].all(), "padding rows go last"
    keys = list(zip(c[order][real], a[order][real], d[order][real]))
    assert keys == sorted(keys)
    for got, want in zip(sorted_spec.q_meta, (a, d, c)):
        np.testing.assert_array_equal(np.asarray(got[0]), want[order])
    for got, want in zip(sorted_spec.kv_meta, (a, d, c)):  # the keys keep their layout
        np.testing.assert_array_equal(np.asarray(got[0]), want)


def test_permute_rows_and_its_gradient():
    order = jnp.asarray(np.random.default_rng(0).permutation(37)[None], jnp.int32)
    inverse = jnp.argsort(order, axis=-1).astype(jnp.int32)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 37, 3, 8)), jnp.float32)
    ct = jnp.asarray(np.random.default_rng(2).standard_normal((1, 37, 3, 8)), jnp.float32)
    got, vjp = jax.vjp(lambda x: chain.permute_rows(x, order, inverse), x)
    want, want_vjp = jax.vjp(lambda x: x[:, order[0]], x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(vjp(ct)[0], want_vjp(ct)[0])
    np.testing.assert_array_equal(chain.permute_rows(got, inverse, order), x)


def test_sorted_queries_visit_fewer_pairs():
    # a trainer-like COD layout: 1024 positions, the first 10% unsupervised, K 8, retention
    # 0.7^d down to 0.2; the block loop after the split, in the layout's and in sorted order
    n = 1024
    sup = np.arange(n) >= n // 10
    a, d = cod_sample(sup, np.zeros(n, np.int32), 8, rng=0)
    c = np.zeros_like(a)
    spec = kernels.AttentionSpec.peagle(a, d, c, chain_depth=7)

    def visited(spec, bq=32, bk=128):
        meta = [
            pad_rows(x, b, v) for x, b, v in zip((*spec.q_meta, *spec.kv_meta), (bq,) * 3 + (bk,) * 3, (0, 0, -1) * 2)
        ]
        return int(build_schedule(tuple(meta[:3]), tuple(meta[3:]), bq, bk, None, 16).fwd_count.sum()) * bq * bk

    block_spec, _, _ = chain.split(spec)
    sorted_spec, _, _ = chain.sort_queries(block_spec)
    visible = int(np.sum(a + 1))
    assert visible <= visited(sorted_spec) <= 0.95 * visited(block_spec)
