"""Pallas GPU (Triton) kernels: interpret mode on CPU vs the reference, and a check that
the kernels lower to Triton (cross-platform lowering, no GPU needed). With a GPU,
``python -m bench.gpu_check`` runs the ``gpu``-marked tests natively."""

import jax
import jax.numpy as jnp
import pytest

from kernels import AttentionSpec, attention
from kernels import cases as kt

BLOCKS = dict(block_q=32, block_k=16)
CASES = [kt.CASE_COD_F32, kt.CASE_COD_BF16, kt.CASE_CAUSAL, kt.CASE_BLOCK]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gpu_interpret_matches_reference(case):
    kt.assert_backend_matches_reference(case, "gpu", interpret=True, **BLOCKS)


def test_gpu_interpret_deterministic():
    kt.assert_deterministic(kt.CASE_COD_F32, "gpu", interpret=True, **BLOCKS)


def test_gpu_kernels_lower_to_triton():
    B, T, Hq, Hkv, D = 1, 200, 8, 2, 96  # D padded to 128 in the wrapper
    z = jnp.zeros((B, T), jnp.int32)
    spec = AttentionSpec.peagle(z, z, z, softcap=30.0, sliding_window=64)
    q = jax.ShapeDtypeStruct((B, T, Hq, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, T, Hkv, D), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((Hq,), jnp.float32)

    def loss(q, k, v, sinks, spec):
        return jnp.sum(attention(q, k, v, spec, sinks=sinks, backend="gpu", block_q=64, block_k=32).astype(jnp.float32))

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    text = f.trace(q, k, k, sinks, spec).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3  # fwd, dq, dkv


# ---- native runs on a GPU (deselected by default; python -m bench.gpu_check runs them) -------
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gpu_native_matches_reference(case):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    # natively: bf16 tolerances for every dtype
    kt.assert_backend_matches_reference(case, "gpu", tol=kt.TOLERANCE["bfloat16"], **BLOCKS)


@pytest.mark.gpu
def test_gpu_native_deterministic():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    kt.assert_deterministic(kt.CASE_COD_BF16, "gpu", **BLOCKS)
