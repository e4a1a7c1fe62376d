"""The trainer's loss and gradients on the golden COD rows (tests/golden/peagle-tiny/train_rows.npz):
the golden loss (speculators 0.9.0, stored with the rows) and the same parameter gradients as
speculators' own PyTorch `PEagleDraftModel` on the same rows."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paths import VECTORS

from peagle_jax.formats.checkpoints import speculators_tensors
from peagle_jax.handles.drafter import load_drafter
from peagle_jax.models.eagle import param_path
from train.spec import LossSpec
from train.step import loss_and_metrics, split_params


@pytest.fixture(scope="module")
def golden():
    from safetensors.numpy import load_file

    rows = dict(np.load(VECTORS / "train_rows.npz"))
    w = load_file(str(VECTORS / "target" / "model.safetensors"))
    eps = json.loads((VECTORS / "target" / "config.json").read_text())["rms_norm_eps"]
    return rows, w["model.norm.weight"], w["lm_head.weight"], eps


def _our_loss_and_grads(golden, attention="dense"):
    rows, norm_w, lm_head, eps = golden
    drafter = load_drafter(VECTORS / "drafter-speculators")
    parts, params, frozen = split_params(drafter, freeze_embed=False, freeze_lm_head=False)
    x = rows["prenorm_last_hidden"].astype(np.float32)
    y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * norm_w
    t = len(rows["input_ids"])
    # the vectors feed row r with input_ids[ref], aux[ref], teacher at ref (no shift); the trainer
    # shifts (row t: token t+1, teacher t+1), so the inputs are laid out one position later
    tokens = np.concatenate([[0], rows["input_ids"]]).astype(np.int32)[None]
    aux = np.concatenate([rows["aux_hidden"], np.zeros((1, rows["aux_hidden"].shape[1]))]).astype(np.float32)[None]
    yy = np.concatenate([np.zeros((1, y.shape[1])), y]).astype(np.float32)[None]
    sup = np.concatenate([rows["loss_mask"].astype(bool), [False]])[None]
    batch = {
        "tokens": tokens,
        "positions": np.arange(t + 1, dtype=np.int32)[None],
        "sup": sup,
        "anchor": rows["anchor"].astype(np.int32)[None],
        "depth": rows["depth"].astype(np.int32)[None],
        "doc": np.zeros((1, len(rows["anchor"])), np.int32),
    }
    used = np.arange(drafter.config.draft_vocab_size) + drafter.d2t
    head_w = jnp.asarray(lm_head[used])

    def f(p):
        return loss_and_metrics(
            parts,
            p,
            frozen,
            jnp.asarray(aux),
            jnp.asarray(yy),
            head_w,
            batch,
            LossSpec(mode="parallel", k=4, per_depth=False, chain_decay=1.0, softcap=None, attention=attention),
        )

    (loss, m), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(params)
    return drafter, float(loss), m, grads


def test_one_step_gives_the_golden_loss(golden):
    _, loss, m, _ = _our_loss_and_grads(golden)
    assert abs(loss - float(golden[0]["loss"])) < 1e-6, loss
    np.testing.assert_array_equal(np.asarray(m["total"]), [13, 8, 5, 3])


@pytest.mark.speculators
def test_gradients_match_speculators(golden, monkeypatch):
    torch = pytest.importorskip("torch")
    pytest.importorskip("speculators", exc_type=ImportError)
    from safetensors.torch import load_file
    from speculators.config import SpeculatorModelConfig
    from speculators.losses.eager import kl_div_loss
    from speculators.models.peagle import PEagleDraftModel
    from speculators.models.peagle import core as peagle_core

    rows, norm_w, lm_head, eps = golden
    drafter, loss, _, grads = _our_loss_and_grads(golden)

    folder = VECTORS / "drafter-speculators"
    cfg = SpeculatorModelConfig.from_dict(json.loads((folder / "config.json").read_text()))
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = PEagleDraftModel(cfg)
    state = load_file(str(folder / "model.safetensors"))
    t2d = state["t2d"].bool()
    state["verifier_lm_head.weight"] = torch.as_tensor(lm_head)[t2d]
    state["verifier_norm.weight"] = torch.as_tensor(norm_w)
    res = model.load_state_dict(state, strict=False)
    assert res.missing_keys == [] and res.unexpected_keys == [], res
    for name, p in model.named_parameters():
        p.requires_grad_(not name.startswith("verifier_"))
    anchor, depth = torch.as_tensor(rows["anchor"]).long(), torch.as_tensor(rows["depth"]).long()
    monkeypatch.setattr(peagle_core, "generate_cod_sample_indices", lambda **kw: (anchor, depth))
    t = len(rows["input_ids"])
    _, their_loss, _ = model(
        hidden_states=torch.as_tensor(rows["aux_hidden"]).float()[None],
        input_ids=torch.as_tensor(rows["input_ids"]).long()[None],
        document_ids=torch.zeros(1, t, dtype=torch.long),
        loss_mask=torch.as_tensor(rows["loss_mask"]).float()[None],
        verifier_last_hidden_states=torch.as_tensor(rows["prenorm_last_hidden"]).float()[None],
        num_depths=4,
        loss_config={"kl_div": (kl_div_loss, 1.0)},
    )  # eager: no Triton
    their_loss.backward()
    assert abs(float(their_loss) - float(rows["loss"])) < 1e-6
    assert abs(loss - float(their_loss)) < 1e-6

    ours = speculators_tensors(
        drafter.config,
        {param_path(k): np.asarray(v) for k, v in grads.items()} | {("d2t",): drafter.d2t.astype(np.int32)},
        "float32",
    )
    theirs = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
    assert set(theirs) <= set(ours), set(theirs) - set(ours)
    assert len(theirs) >= 15
    for name, g in theirs.items():
        scale = max(float(np.abs(g).max()), 1e-6)
        err = float(np.abs(ours[name] - g).max()) / scale
        assert err < 1e-5, (name, err)
