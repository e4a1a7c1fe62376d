"""D-PACE block-slot weights (`--loop.dflash_weights dpace`, train/blocks.py `dpace_weights`):
the weights and the DFlash loss with them equal speculators 0.9.0's (`dpace_loss_decay` in
speculators/losses/utils.py, through `DFlashDraftModel.forward` with per_position_loss_weight
dpace), the flag reaches a trainer run's loss, and the default stays exp-decay."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_train_dflash as train_dflash
from test_train_dflash import block_batch

from peagle_jax.runtime.command_line import UsageError
from train.blocks import block_loss_and_metrics, dpace_weights
from train.flags import parse_args
from train.loop import run
from train.spec import LossSpec
from train.step import split_params


def speculators_dpace(torch, ce, sup, block_size, alpha):
    """Their weights of each sequence (their batch is one packed sequence: [1, n*bs])."""
    from speculators.losses import dpace_loss_decay

    rows = []
    for c, m in zip(ce, sup, strict=True):
        mask = torch.as_tensor(m, dtype=torch.float32)[None]
        # their loss_function hands the masked elementwise loss to the decay function
        loss = torch.as_tensor(c)[None] * mask
        pos = torch.arange(len(c))[None] % block_size
        rows.append(dpace_loss_decay(pos, mask, block_size, alpha, elementwise_loss=loss)[0].numpy())
    return np.stack(rows)


@pytest.mark.speculators
@pytest.mark.parametrize("alpha", [0.5, 0.2, 1.0])
def test_dpace_weights_equal_speculators(alpha):
    """Two sequences of 5 blocks of 6 slots: slot 0 and some drafts unsupervised, a padding block."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("speculators", exc_type=ImportError)
    bs, n = 6, 5
    rng = np.random.default_rng(3)
    ce = rng.exponential(1.5, (2, n * bs)).astype(np.float32)
    sup = rng.random((2, n * bs)) < 0.8
    sup[:, ::bs] = False  # the anchor slot
    sup[1, -bs:] = False  # a padding block
    want = speculators_dpace(torch, ce, sup, bs, alpha)
    got = np.asarray(dpace_weights(jnp.asarray(ce), jnp.asarray(sup), bs, alpha))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    assert np.all(got[~sup] == 0) and np.all(got[sup] > 0)
    assert not np.allclose(got[sup], got[sup][0])  # the weights do depend on the confidence


def our_loss(drafter, aux, y, head_w, ids, mask, anchors, valid, **kw):
    parts, params, frozen = split_params(drafter, True, True)
    _, arrays = block_batch(ids, mask, anchors, valid)
    spec = LossSpec(mode="dflash", dflash_gamma=4.0, ce_weight=1.0, softcap=None, attention="dense", **kw)
    lossf = functools.partial(block_loss_and_metrics, parts, spec=spec)
    (loss, _), grads = jax.jit(jax.value_and_grad(lossf, has_aux=True))(
        params, frozen, aux[None], y[None], head_w, arrays
    )
    return float(loss), grads


def speculators_loss(model, torch, core, eager, inputs, monkeypatch, **kw):
    loss, _ = train_dflash.speculators_loss(
        model, torch, core, {"ce": (eager.ce_loss, 1.0)}, *inputs, monkeypatch, **kw
    )
    return loss


@pytest.mark.speculators
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("case,alpha", [("tiny", 0.5), ("tiny-Vd<V", 0.5), ("tiny-Vd<V", 0.25)])
def test_dpace_loss_equals_speculators(case, alpha, monkeypatch):
    """Their DFlash forward with CE and per_position_loss_weight dpace; ours with loop.ce_weight 1 and
    dflash_weights dpace. The exp-decay loss of the same inputs is another number."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("speculators", exc_type=ImportError)
    parity = pytest.importorskip("test_dflash_parity")
    from speculators.losses import eager
    from speculators.models.dflash import core

    c = parity.CASES[case]
    model = parity.speculators_model(c)
    drafter = parity.our_drafter(c, model)
    aux, ids = parity.inputs(c)
    rng = np.random.default_rng(11)
    mask = rng.random(len(ids)) < 0.75
    hidden = rng.standard_normal((len(ids), c["hidden"])).astype(np.float32)
    valid = np.ones(len(parity.ANCHORS), bool)
    valid[-1] = False  # a padding block
    inputs = (aux, ids, mask, hidden, np.asarray(parity.ANCHORS), valid)
    want = speculators_loss(model, torch, core, eager, inputs, monkeypatch, per_position_loss_weight="dpace",
                            dpace_alpha=alpha)  # fmt: skip
    with torch.no_grad():
        y = model.verifier_norm(torch.as_tensor(hidden)).numpy()
    head_w = jnp.asarray(model.verifier_lm_head.weight.detach().numpy())
    ours = functools.partial(our_loss, drafter, jnp.asarray(aux), jnp.asarray(y), head_w, ids, mask, inputs[4], valid)
    got, grads = ours(dflash_weights="dpace", dpace_alpha=alpha)
    assert want > 0 and abs(got - want) <= 1e-5 * abs(want), (case, alpha, got, want)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    exp_loss, _ = ours()  # the default: exp-decay weights
    assert abs(exp_loss - got) > 1e-3 * abs(got), (exp_loss, got)


def test_the_default_is_exp_decay_and_dpace_is_refused_where_it_does_not_apply():
    lp = parse_args(["--preset", "tiny", "--model.mode", "dflash"]).loop
    assert (lp.dflash_weights, lp.dpace_alpha) == ("exp", 0.5)
    base = ["--preset", "tiny", "--model.mode", "dflash", "--loop.dflash_weights", "dpace"]
    assert parse_args([*base, "--loop.ce_weight", "1"]).loop.dflash_weights == "dpace"
    for extra, message in [
        ([], "needs --loop.ce_weight 1"),
        (["--loop.ce_weight", "1", "--model.mode", "parallel"], "needs --model.mode dflash"),
        (["--loop.ce_weight", "1", "--loop.dpace_alpha", "0"], r"loop.dpace_alpha must be a number in \(0, 1\]"),
        (["--loop.dflash_weights", "linear"], "loop.dflash_weights must be exp or dpace"),
    ]:
        with pytest.raises(UsageError, match=message):
            parse_args([*base, *extra])


def test_the_flag_reaches_a_trainer_runs_loss(tmp_path):
    """One step of the tiny DFlash run with CE: dpace's first loss is not exp-decay's (same seed, same
    batch), and both are finite."""
    from train.tiny import build_tiny_target

    target = build_tiny_target(tmp_path / "target")

    def first_loss(name, *extra):
        argv = ["--preset", "tiny", "--model.mode", "dflash", "--model.target", str(target), "--out",
                str(tmp_path / name), "--loop.steps", "1", "--loop.progress", "false", "--eval.enabled", "false",
                "--data.heldout", "0", "--loop.ce_weight", "1", *extra]  # fmt: skip
        return run(parse_args(argv))["first_loss"]

    exp_loss, dpace_loss = first_loss("exp"), first_loss("dpace", "--loop.dflash_weights", "dpace")
    assert np.isfinite(exp_loss) and np.isfinite(dpace_loss)
    assert abs(dpace_loss - exp_loss) > 1e-3 * abs(exp_loss), (exp_loss, dpace_loss)
