"""Decode attention over a KV cache (cost follows the filled length) vs the dense reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import AttentionSpec, decode, reference


def _case(seed, b, t, s, hq, hkv, d, dtype):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (b, t, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, s, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, s, hkv, d), jnp.float32).astype(dtype)
    sinks = jax.random.normal(ks[3], (hq,), jnp.float32)
    return q, k, v, sinks


def _reference(q, k, v, q_pos, window, softcap, sinks, scale):
    s = k.shape[1]
    spec = AttentionSpec.causal(
        q_pos,
        jnp.broadcast_to(jnp.arange(s), (q.shape[0], s)),
        q_valid=q_pos >= 0,
        sliding_window=window,
        softcap=softcap,
        scale=scale,
    )
    return reference.attention(q, k, v, spec, sinks=sinks)[0]


@pytest.mark.parametrize(
    "window, softcap, with_sinks, hkv",
    [(None, None, False, 1), (7, 20.0, True, 2), (None, None, True, 2), (7, None, False, 1)],
)
def test_decode_matches_reference(window, softcap, with_sinks, hkv):
    """Ragged rows (different filled lengths), padding rows, GQA, window, softcap, sinks; the
    cache length (40) is not a multiple of the block (16), so the last block is clamped."""
    q, k, v, sinks = _case(0, 3, 5, 40, 4, hkv, 16, jnp.float32)
    q_pos = jnp.array([[3, 4, 5, 6, 7], [30, 31, 32, 33, 39], [-1, -1, -1, -1, -1]])
    q_pos = q_pos.at[0, 4].set(-1)  # a padding slot inside a real row
    sk = sinks if with_sinks else None
    got = decode.attention(q, k, v, q_pos, scale=0.25, softcap=softcap, sinks=sk, window=window, block=16)
    want = _reference(q, k, v, q_pos, window, softcap, sk, 0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert np.all(np.asarray(got)[2] == 0)
    assert np.all(np.asarray(got)[0, 4] == 0)


def test_decode_bf16_and_reads_only_filled_blocks():
    q, k, v, _ = _case(1, 2, 3, 64, 4, 2, 32, jnp.bfloat16)
    q_pos = jnp.array([[10, 11, 12], [20, 21, 22]])
    got = decode.attention(q, k, v, q_pos, scale=32**-0.5, block=8)
    want = _reference(q, k, v, q_pos, None, None, None, 32**-0.5)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)
    assert int(decode.filled_blocks(q_pos, 64, 8)) == 3  # blocks of 8 holding keys 0..22
    assert int(decode.filled_blocks(q_pos, 64, 8, window=4)) == 3  # keys 7..22: blocks 0..2
    assert int(decode.filled_blocks(q_pos, 64, 8, window=3)) == 2  # keys 8..22: blocks 1..2
    # stale values past the filled length never matter
    k2 = k.at[:, 23:].set(1e4)
    got2 = decode.attention(q, k2, v.at[:, 23:].set(1e4), q_pos, scale=32**-0.5, block=8)
    np.testing.assert_array_equal(np.asarray(got2), np.asarray(got))


def test_one_compile_serves_every_filled_length():
    q, k, v, _ = _case(2, 1, 1, 256, 2, 1, 8, jnp.float32)
    traces = []

    @jax.jit
    def step(q, k, v, pos):
        traces.append(1)
        return decode.attention(q, k, v, pos, scale=1.0, block=32)

    for p in (0, 31, 32, 200, 255):
        got = step(q, k, v, jnp.array([[p]]))
        want = _reference(q, k, v, jnp.array([[p]]), None, None, None, 1.0)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    assert len(traces) == 1
