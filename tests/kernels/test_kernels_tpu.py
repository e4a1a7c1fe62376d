"""Pallas TPU (Mosaic) kernels on CPU: the plain Pallas interpreter for the test matrix,
TPU interpret mode (``pltpu.force_tpu_interpret_mode``: simulated SMEM/VMEM, DMAs and
scalar prefetch) for one case, and a check that the kernels lower to Mosaic."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernels import AttentionSpec, attention
from kernels import cases as kt


@pytest.mark.parametrize(
    "case", [kt.CASE_COD_F32_LONG, kt.CASE_COD_BF16_LONG, kt.CASE_CAUSAL_LONG, kt.CASE_BLOCK_LONG], ids=lambda c: c.name
)
def test_tpu_interpret_matches_reference(case):
    kt.assert_backend_matches_reference(case, "tpu", interpret="generic")


def test_tpu_interpret_deterministic():
    kt.assert_deterministic(kt.CASE_COD_F32_LONG, "tpu", interpret="generic")


@pytest.mark.slow  # ~40-80 s: simulated SMEM/VMEM and DMAs; the generic interpreter checks the matrix above
def test_tpu_interpret_mode_matches_reference():
    # TPU interpret mode is slow on CPU (~0.1 s per grid step): a small two-block problem
    case = kt.Case(
        "cod_tpu_interpret_mode",
        "float32",
        hq=2,
        hkv=1,
        d=32,
        layouts=((70, 4, 0.7, 2, None),),
        pad_extra=3,
        sinks=True,
        softcap=10.0,
    )
    with pltpu.force_tpu_interpret_mode():
        kt.assert_backend_matches_reference(case, "tpu")


def test_tpu_kernels_lower_to_mosaic():
    B, T, Hq, Hkv, D = 2, 300, 8, 2, 128
    z = jnp.zeros((B, T), jnp.int32)
    spec = AttentionSpec.peagle(z, z, z, softcap=30.0, sliding_window=64)
    q = jax.ShapeDtypeStruct((B, T, Hq, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((B, T, Hkv, D), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((Hq,), jnp.float32)

    def loss(q, k, v, sinks, spec):
        return jnp.sum(
            attention(q, k, v, spec, sinks=sinks, backend="tpu", block_q=128, block_k=256).astype(jnp.float32)
        )

    f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    text = f.trace(q, k, k, sinks, spec).lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 3  # fwd, dq, dkv
