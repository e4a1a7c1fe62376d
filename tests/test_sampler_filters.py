"""top_k and top_p cut-offs found by bisection (no sort of the vocabulary) against the sort-based
rule written in numpy: the same tokens kept, ties, -inf, -0.0 and one-token rows included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from peagle_jax.engine import sampler


def sorted_top_k(x: np.ndarray, k: np.ndarray) -> np.ndarray:
    kth = np.take_along_axis(-np.sort(-x, axis=-1), k - 1, axis=-1)
    return x >= kth


def sorted_top_p(probs: np.ndarray, p: np.ndarray) -> np.ndarray:
    desc = -np.sort(-probs, axis=-1)
    kept = (np.cumsum(desc, axis=-1) - desc) < p
    return probs >= np.min(np.where(kept, desc, np.inf), axis=-1, keepdims=True)


def logits(rng, vocab: int) -> np.ndarray:
    x = (rng.normal(size=(3, 2, vocab)) * rng.choice([0.01, 1.0, 30.0])).astype(np.float32)
    x[..., : vocab // 3] = np.round(x[..., : vocab // 3])  # ties
    x[0, 0, :2] = -np.inf
    x[1, 1, :2], x[1, 1, 2:4] = -0.0, 0.0
    return x


@jax.jit
def bisected(x, k, p):
    """The tokens top_k keeps of x and those top_p keeps of softmax(x)."""
    keys, probs = sampler._order_keys(x), jax.nn.softmax(x, axis=-1)
    top_k = keys >= sampler.kth_largest_key(keys, k)
    return top_k, sampler._order_keys(probs) >= sampler.nucleus_cutoff_key(probs, p), probs


@pytest.mark.parametrize("vocab", [1, 7, 4099])
def test_the_bisected_cut_offs_keep_what_a_sort_keeps(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(6):
        x = logits(rng, vocab)
        k = rng.integers(1, vocab + 1, size=(3, 2, 1)).astype(np.int32)
        p = rng.uniform(0.01, 1.0, size=(3, 2, 1)).astype(np.float32)
        top_k, top_p, probs = bisected(x, k, p)
        assert np.array_equal(top_k, sorted_top_k(x, k))
        assert np.array_equal(top_p, sorted_top_p(np.asarray(probs), p))


def test_a_nucleus_keeps_the_top_token_and_sums_to_one():
    probs = sampler.warp_probs(jnp.asarray([[4.0, 1.0, 1.0, 0.0]]), 1.0, 0.01)
    assert np.asarray(probs).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    probs = np.asarray(sampler.warp_probs(jnp.asarray([[1.0, 1.0, 1.0, 0.0]]), 1.0, 0.5))
    assert probs[0, :3] == pytest.approx([1 / 3] * 3) and probs[0, 3] == 0.0  # ties at the cut all kept
