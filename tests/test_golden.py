"""The drafter against golden vectors from vllm-project/speculators 0.9.0 (tests/golden).

peagle-tiny: a 2-layer P-EAGLE head in the speculators layout (Vd 128 of V 256, mask id 255)
for a tiny random 8-layer Llama target. Rows are fed exactly as the vectors' README says:
row r reads input_ids[ref] and aux_hidden[ref] (ref = anchor + depth) at depth 0, the mask
token and mask_hidden at depth > 0, position id = ref.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from paths import VECTORS

from peagle_jax.engine import cache as kv
from peagle_jax.handles.drafter import load_drafter
from peagle_jax.models.eagle import cod_rows_forward, draft_to_target, peagle_mask
from train.loss import LossRows, argmax_in_draft, draft_loss, teacher_logits

TOL = 1e-5
_cod_jit = jax.jit(lambda gd, st, *a: cod_rows_forward(nnx.merge(gd, st), *a), static_argnums=(0,))


@pytest.fixture(scope="module")
def drafter():
    return load_drafter(VECTORS / "drafter-speculators")


@pytest.fixture(scope="module")
def rows():
    return dict(np.load(VECTORS / "train_rows.npz"))


@pytest.fixture(scope="module")
def propose():
    return dict(np.load(VECTORS / "propose.npz"))


@pytest.fixture(scope="module")
def target_head():
    """(final norm weight [H], lm_head weight [V, H], eps) of the tiny target, read directly."""
    import json

    from safetensors.numpy import load_file

    w = load_file(str(VECTORS / "target" / "model.safetensors"))
    eps = json.loads((VECTORS / "target" / "config.json").read_text())["rms_norm_eps"]
    return w["model.norm.weight"], w["lm_head.weight"], eps


def test_config_read(drafter):
    c = drafter.config
    assert (c.mode, c.num_layers, c.hidden_size, c.vocab_size, c.draft_vocab_size) == ("parallel", 2, 64, 256, 128)
    assert c.mask_token_id == 255
    assert c.aux_layer_ids == (2, 4, 5)
    assert c.k_train == 5
    assert not (c.norm_before_residual or c.norm_before_fc or c.fc_norm or c.norm_output or c.attention_bias)
    assert int(drafter.t2d.sum()) == 128


def test_mask_rule_matches(rows):
    anchor, depth = jnp.asarray(rows["anchor"]), jnp.asarray(rows["depth"])
    mask = np.asarray(peagle_mask(anchor, depth, jnp.zeros_like(anchor)))
    np.testing.assert_array_equal(mask, rows["mask"])


def _cod_args(rows):
    return [
        jnp.asarray(a)[None]
        for a in (rows["input_ids"], rows["aux_hidden"], rows["anchor"], rows["depth"], np.zeros_like(rows["anchor"]))
    ]


def _cod_logits(drafter, rows):
    return np.asarray(_cod_jit(drafter.graphdef, drafter.state, *_cod_args(rows))[0])


def test_cod_rows_logits(drafter, rows):
    logits = _cod_logits(drafter, rows)
    diff = np.abs(logits - rows["draft_logits"]).max()
    assert diff < TOL, diff


def test_cod_rows_through_the_kernels_match_golden_and_dense_gradients(drafter, rows):
    """The blockwise kernel path (no [N, N] mask) gives the golden logits and the same
    parameter gradients as the dense-mask path."""
    args = _cod_args(rows)

    def loss(state, mask):
        logits = cod_rows_forward(nnx.merge(drafter.graphdef, state), *args, mask=mask)
        return jnp.sum(jax.nn.log_softmax(logits) * jnp.cos(jnp.arange(logits.shape[-1])))

    got = np.asarray(
        jax.jit(lambda st: cod_rows_forward(nnx.merge(drafter.graphdef, st), *args, mask="kernels"))(drafter.state)[0]
    )
    assert np.abs(got - rows["draft_logits"]).max() < TOL
    grads = jax.jit(jax.grad(loss, allow_int=True), static_argnums=1)
    dense, blockwise = grads(drafter.state, None), grads(drafter.state, "kernels")
    for a, b in zip(jax.tree.leaves(dense), jax.tree.leaves(blockwise)):
        if jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5)


def _loss_inputs(drafter, rows, target_head):
    norm_w, lm_head, eps = target_head
    ref = rows["anchor"] + rows["depth"]
    x = rows["prenorm_last_hidden"].astype(np.float32)
    y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * norm_w  # target final norm
    teacher = teacher_logits(jnp.asarray(y[ref]), jnp.asarray(lm_head), jnp.asarray(drafter.d2t))
    return y, ref, teacher


def test_loss_definition(drafter, rows, target_head):
    """Our loss equals an independent numpy forward KL over the draft vocabulary
    (speculators' formula: softmax of the target logits at the draft ids, KL summed per
    row, masked by the loss mask at ref, one division by the supervised row count)."""
    _, lm_head, _ = target_head
    y, ref, teacher = _loss_inputs(drafter, rows, target_head)
    logits = _cod_logits(drafter, rows)
    mask, depth = jnp.asarray(rows["loss_mask"][ref]), jnp.asarray(rows["depth"])
    out = draft_loss(jnp.asarray(logits), teacher, LossRows(mask, depth, num_depths=4))

    ids = np.nonzero(drafter.t2d)[0]
    t = (y[ref] @ lm_head.T)[:, ids].astype(np.float64)
    logp = t - t.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    d = logits.astype(np.float64)
    logq = d - d.max(-1, keepdims=True)
    logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
    kl = (np.exp(logp) * (logp - logq)).sum(-1)
    m = rows["loss_mask"][ref]
    want = (kl * m).sum() / m.sum()
    assert abs(float(out.loss) - want) < TOL, (float(out.loss), want)
    np.testing.assert_array_equal(np.asarray(out.total), [13, 8, 5, 3])  # supervised rows per depth
    hits = (logits.argmax(-1) == t.argmax(-1)) * m
    np.testing.assert_array_equal(np.asarray(out.correct), [hits[rows["depth"] == k].sum() for k in range(4)])
    # the row filter "target argmax in the draft vocab" is available as a separate mask
    full = jnp.asarray(y[ref] @ lm_head.T)
    assert np.asarray(argmax_in_draft(full, jnp.asarray(drafter.t2d))).dtype == bool


def test_loss_golden_value(drafter, rows, target_head):
    """The corrected golden loss (0.5964163: teacher of row (a, d) at position a + d, KL summed
    over the vocabulary and the supervised rows, divided by count + 1e-5) to 1e-6."""
    _, ref, teacher = _loss_inputs(drafter, rows, target_head)
    out = draft_loss(jnp.asarray(_cod_logits(drafter, rows)), teacher, LossRows(jnp.asarray(rows["loss_mask"][ref])))
    assert abs(float(out.loss) - float(rows["loss"])) < 1e-6, (float(out.loss), float(rows["loss"]))


def _slots(drafter, p):
    """vLLM's single-pass layout: prompt[1:] + [bonus] with aux 0..11, then K-1 = 4 mask slots."""
    k1 = 4
    tokens = np.concatenate([p["prompt"][1:], [p["bonus"]], [drafter.config.mask_token_id] * k1])
    g = jnp.concatenate(
        [
            drafter.fuse(jnp.asarray(p["aux_hidden"])),
            jnp.broadcast_to(drafter.model.mask_g(), (k1, drafter.config.hidden_size)),
        ]
    )
    return jnp.asarray(tokens)[None], g[None], jnp.arange(tokens.shape[0])[None]


def test_propose_single_pass(drafter, propose):
    tokens, g, pos = _slots(drafter, propose)
    out = drafter.apply(tokens, g, pos)
    slot_logits = np.asarray(out.logits[0, 11:])
    diff = np.abs(slot_logits - propose["slot_logits"]).max()
    assert diff < TOL, diff
    drafts = np.asarray(draft_to_target(jnp.asarray(drafter.d2t), jnp.argmax(out.logits[0, 11:], -1)))
    np.testing.assert_array_equal(drafts, propose["drafts"])


@pytest.mark.parametrize("split", [12, 11])
def test_propose_with_cache(drafter, propose, split):
    """Prefill the first `split` slots into the KV cache, then the rest in a second call
    (split 11: vLLM's shape, bonus slot + mask slots together) == the one-shot pass."""
    tokens, g, pos = _slots(drafter, propose)
    one_shot = drafter.apply(tokens, g, pos).logits
    cache = kv.init(drafter.config, 1, 24)
    first = drafter.apply(tokens[:, :split], g[:, :split], pos[:, :split], cache)
    second = drafter.apply(tokens[:, split:], g[:, split:], pos[:, split:], first.cache)
    split_logits = jnp.concatenate([first.logits, second.logits], axis=1)
    assert float(jnp.abs(split_logits - one_shot).max()) < TOL
    diff = np.abs(np.asarray(split_logits[0, 11:]) - propose["slot_logits"]).max()
    assert diff < TOL, diff
    # the mask slots wrote KV at positions 12..15; a next round overwrites them in place
    k0 = second.cache[0][0]
    assert float(jnp.abs(k0[0, 12:16]).sum()) > 0
    assert float(jnp.abs(k0[0, 16:]).sum()) == 0
