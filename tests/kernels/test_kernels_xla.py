"""Blockwise XLA path vs the dense reference (forward, lse, gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from kernels import cases as kt

BLOCKS = dict(block_q=32, block_k=16)


@pytest.mark.parametrize(
    "case",
    [kt.CASE_COD_F32, kt.CASE_COD_BF16, kt.CASE_COD_GROUPED, kt.CASE_CAUSAL, kt.CASE_BLOCK],
    ids=lambda c: c.name,
)
def test_xla_matches_reference(case):
    kt.assert_backend_matches_reference(case, "xla", **BLOCKS)


def test_xla_kv_blocks_wider_than_query_blocks():
    """The default's shape (128 x 512, scaled down to 4 x 16): one KV block spans four query
    blocks; these layouts then have both full tiles (the unmasked branch) and partial ones."""
    for case in (kt.CASE_COD_F32, kt.CASE_COD_GROUPED):
        kt.assert_backend_matches_reference(case, "xla", block_q=4, block_k=16)


def test_xla_deterministic():
    kt.assert_deterministic(kt.CASE_COD_F32, "xla", **BLOCKS)


def test_auto_is_xla_on_cpu_and_fully_masked_rows():
    assert kernels.resolve_backend("auto") == "xla"  # tests run on CPU
    with pytest.raises(ValueError, match="unknown attention backend"):
        kernels.resolve_backend("cuda")
    pos = jnp.arange(20)[None]
    spec = kernels.AttentionSpec.causal(pos, q_valid=pos < 12)
    q = jax.random.normal(jax.random.PRNGKey(0), (1, 20, 2, 16))

    def f(q):
        out, lse = kernels.attention(q, q, q, spec, return_lse=True, block_q=8, block_k=8)
        return jnp.sum(out), (out, lse)

    g, (out, lse) = jax.jit(jax.grad(f, has_aux=True))(q)
    assert np.all(np.asarray(out)[0, 12:] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[0, :, 12:]))
    assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(g)[0, 12:] == 0)
