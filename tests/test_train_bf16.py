"""`--model.compute_dtype bfloat16`: the head's matmuls run in bf16 while its parameters and
their gradients stay float32 (master weights), and the loss is close to the f32 one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from peagle_jax.config.drafter_config import DrafterConfig
from peagle_jax.handles.drafter import Drafter
from peagle_jax.models.eagle import cod_rows_forward
from train.step import compute_parts, split_params

V, H = 64, 32
CONFIG = DrafterConfig(
    hidden_size=H,
    target_hidden_size=H,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    intermediate_size=48,
    vocab_size=V,
    draft_vocab_size=V,
    mask_token_id=V - 1,
    aux_layer_ids=(1, 2, 3),
    k_train=2,
    max_position_embeddings=64,
)


def test_bf16_compute_over_f32_master_weights():
    parts, params, frozen = split_params(Drafter.random(CONFIG, seed=1), False, False)
    bf16 = compute_parts(parts, CONFIG, "bfloat16", "float32")
    assert compute_parts(parts, CONFIG, "float32", "float32") is parts
    rng = np.random.default_rng(0)
    n = 12
    tokens = jnp.asarray(rng.integers(0, V, (1, n)), jnp.int32)
    aux = jnp.asarray(rng.standard_normal((1, n, 3 * H)), jnp.float32)
    anchor = jnp.arange(n, dtype=jnp.int32)[None]
    zeros = jnp.zeros((1, n), jnp.int32)

    def loss(p, which):
        logits = cod_rows_forward(which.merge(p, frozen), tokens, aux, anchor, zeros, zeros, mask="dense")
        return jnp.mean(jax.nn.logsumexp(logits, -1)), logits

    jaxpr = str(jax.make_jaxpr(lambda p: loss(p, bf16))(params))
    assert "bf16" in jaxpr
    assert "dot_general" in jaxpr
    assert "bf16" not in str(jax.make_jaxpr(lambda p: loss(p, parts))(params))
    (l16, logits16), g16 = jax.jit(jax.value_and_grad(lambda p: loss(p, bf16), has_aux=True))(params)
    (l32, _), g32 = jax.jit(jax.value_and_grad(lambda p: loss(p, parts), has_aux=True))(params)
    assert logits16.dtype == jnp.float32  # the head's logits (and so the loss) are f32
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(g16))  # gradients of the f32 masters
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    np.testing.assert_allclose(float(l16), float(l32), rtol=2e-2)
    gn16, gn32 = (float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(g)))) for g in (g16, g32))
    np.testing.assert_allclose(gn16, gn32, rtol=5e-2)
