"""`train.optim`: Muon on the head's matrices, AdamW on the rest; the schedules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from train.config import OptimConfig
from train.optim import MUON_RMS, learning_rate, make_optimizer, muon_dimensions, schedule


def params():
    return {
        "layers.0.self_attn.q_proj.kernel": jnp.ones((16, 32)),
        "fc.kernel": jnp.ones((48, 16)),
        "norm.weight": jnp.ones(16),
        "embed_tokens.embedding": jnp.ones((64, 16)),
        "mask_hidden": jnp.ones((1, 48)),
    }


def test_muon_takes_the_matrices_and_adamw_the_rest():
    dims = muon_dimensions(params())
    assert {k for k, v in dims.items() if v is not None} == {"layers.0.self_attn.q_proj.kernel", "fc.kernel"}


def test_muon_updates_have_adamws_rms_and_the_schedule_is_read_back():
    oc = OptimConfig(optimizer="muon", lr=1e-3, warmup_steps=0, weight_decay=0.0, muon_weight_decay=0.0, clip=1e9)
    opt = make_optimizer(oc, 10)
    p = params()
    state = opt.init(p)
    g = {k: jax.random.normal(jax.random.key(i), v.shape) for i, (k, v) in enumerate(p.items())}
    updates, state = opt.update(g, state, p)
    rms = {k: float(jnp.sqrt(jnp.mean(u**2))) for k, u in updates.items()}
    # Newton-Schulz leaves singular values near, not at, 1: the RMS lands within ~15% of the target
    assert rms["layers.0.self_attn.q_proj.kernel"] == pytest.approx(MUON_RMS * 1e-3, rel=0.15)
    # the rest is Adam: a first step of one size for every element (optax's muon runs its Adam
    # part with Nesterov momentum, so that size is ~1.5 lr, not lr)
    norm = jnp.abs(updates["norm.weight"])
    assert float(norm.std() / norm.mean()) < 1e-3 and 1e-3 <= rms["norm.weight"] <= 2e-3
    assert learning_rate(state) == pytest.approx(1e-3)


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_schedules_warm_up_then_decay_to_the_floor(kind):
    oc = OptimConfig(schedule=kind, lr=1e-3, warmup_steps=4, min_lr_ratio=0.1)
    f = schedule(oc, 20)
    assert float(f(0)) == 0.0 and float(f(4)) == pytest.approx(1e-3) and float(f(20)) == pytest.approx(1e-4)
    if kind == "linear":
        assert float(f(12)) == pytest.approx(0.5 * (1e-3 + 1e-4))
