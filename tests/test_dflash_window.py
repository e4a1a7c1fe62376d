"""Sliding-window DFlash layers (`DrafterConfig.layer_types` / `sliding_window` /
`sliding_window_non_causal`): speculators 0.9.0's `DFlashDraftModel` with a window is the oracle
(its mask key for key, its logits and loss from its saved folder, causal and bidirectional
windows), the engine's cached round equals the no-cache block and decodes losslessly, both
export formats round-trip the window and its causality."""

from __future__ import annotations

import dataclasses
import json

import hf_tiny
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from test_dflash_engine import cached_block_logits, reference_logits

import kernels
import peagle_jax as pj
from peagle_jax.config.fields import ConfigError
from peagle_jax.engine import SpeculativeDecoder
from peagle_jax.engine import speculative as sp
from peagle_jax.formats import export_speculators, export_vllm, inspect_folder, read_drafter
from peagle_jax.handles.drafter import Drafter
from peagle_jax.models.dflash import causal_block_specs

S, F = "sliding_attention", "full_attention"
WINDOW = 3
# (layer_types, sliding_window_non_causal): hybrid causal / bidirectional, all sliding causal
HEADS = {
    "hybrid-causal": ((S, F), False),
    "hybrid-bidirectional": ((S, F), True),
    "sliding-causal": ((S, S), False),
}


def _parity():
    pytest.importorskip("speculators", exc_type=ImportError)
    import test_dflash_parity

    return test_dflash_parity


# ---------------------------------------------------------------------------------------
# the mask, key for key
def _speculators_mask(doc, anchors, bs, window, non_causal):
    from speculators.models.dflash.attention import create_anchor_block_mask_mod
    from torch.nn.attention.flex_attention import create_mask

    length = len(doc)
    mod, q_len, kv_len = create_anchor_block_mask_mod(
        torch.as_tensor(doc), length, torch.as_tensor(anchors), bs, window, non_causal
    )
    return create_mask(mod, None, None, q_len, kv_len, device="cpu")[0, 0].numpy()


@pytest.mark.speculators
@pytest.mark.parametrize("non_causal", [True, False])
@pytest.mark.parametrize("window", [1, 3, 6])
def test_window_rule_equals_speculators_mask(window, non_causal):
    """Bidirectional: the block rule with window W + 1; causal: the context part (window W + 1)
    beside the own-block part of `causal_block_specs`. Packed documents, padding."""
    _parity()
    rng = np.random.default_rng(window)
    length, bs, n = 40, 4, 7
    doc = np.sort(rng.integers(0, 3, length))
    doc[-3:] = -1
    anchors = np.sort(rng.choice(length - bs, n, replace=False))
    want = _speculators_mask(doc, anchors, bs, window, non_causal)
    spec = kernels.AttentionSpec.block(anchors, doc[anchors], np.arange(length), doc, block_size=bs)
    if non_causal:
        got = np.asarray(dataclasses.replace(spec, sliding_window=window + 1).dense_mask()[0])
    else:
        ctx, own = causal_block_specs(spec, length, bs, window + 1)
        got = np.concatenate([np.asarray(ctx.dense_mask()[0]), np.asarray(own.dense_mask()[0])], axis=1)
    full = _speculators_mask(doc, anchors, bs, None, False)
    assert (want != full).any()  # the window hides something: the comparison is not vacuous
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------
# logits and loss from speculators' saved folder
def speculators_window_model(c: dict, layer_types, non_causal: bool, seed: int = 0):
    """test_dflash_parity's random model, rebuilt with sliding layers (the same weights)."""
    from speculators.models.dflash.core import DFlashDraftModel

    par = _parity()
    base = par.speculators_model(c, seed)
    cfg = base.config
    tl = cfg.transformer_layer_config
    tl.layer_types, tl.sliding_window, tl.use_sliding_window = list(layer_types), WINDOW, True
    cfg.sliding_window_non_causal = non_causal
    model = DFlashDraftModel(cfg).eval()
    model.load_state_dict(base.state_dict())
    return model


def load_saved(model, c, folder):
    """Our head read from speculators' `save_pretrained` folder (the verifier's tensors given)."""
    model.save_pretrained(str(folder))
    sd = {k: t.detach().numpy() for k, t in model.state_dict().items()}
    verifier = (sd["embed_tokens.weight"], sd["lm_head.weight"] if c["vd"] == c["vocab"] else None)
    cfg, arrays, _ = read_drafter(folder, target_weights=lambda: verifier)
    return Drafter.from_arrays(cfg, arrays)


@pytest.mark.speculators
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("mask", ["dense", "kernels"])
@pytest.mark.parametrize("head", list(HEADS))
def test_window_logits_equal_speculators(head, mask, tmp_path, monkeypatch):
    par = _parity()
    types, non_causal = HEADS[head]
    c = par.CASES["tiny"]
    model = speculators_window_model(c, types, non_causal)
    drafter = load_saved(model, c, tmp_path / "spec")
    cfg = drafter.config
    assert (cfg.layer_types, cfg.sliding_window, cfg.sliding_window_non_causal) == (types, WINDOW, non_causal)
    aux, ids = par.inputs(c)
    want = par.speculators_logits(model, c, aux, ids, monkeypatch)
    got = par.our_logits(drafter, aux, ids, mask)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < par.TOL, f"{head}/{mask}: max relative difference {err:.2e}"
    slots = np.tile(np.arange(c["block"]) != 0, len(par.ANCHORS))  # slot 0 is the bonus token
    assert np.array_equal(got[slots].argmax(-1), want[slots].argmax(-1))
    # the window and the causality change the logits, so the agreement above is not vacuous
    for other in (dataclasses.replace(cfg, layer_types=(F, F)), dataclasses.replace(cfg, sliding_window_non_causal=not non_causal)):  # fmt: skip
        moved = par.our_logits(Drafter.from_arrays(other, drafter.arrays()), aux, ids, mask)
        assert np.abs(moved - want).max() / np.abs(want).max() > 1e-3, other


@pytest.mark.speculators
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("head", list(HEADS))
def test_window_loss_equals_speculators(head, tmp_path, monkeypatch):
    """The trainer's DFlash loss (`train.blocks`, the blockwise kernels) of a sliding head is
    speculators' KL on the same pinned anchors."""
    from speculators.losses import eager
    from speculators.models.dflash import core
    from test_train_dflash import our_loss, speculators_loss

    par = _parity()
    types, non_causal = HEADS[head]
    c = par.CASES["tiny"]
    model = speculators_window_model(c, types, non_causal)
    drafter = load_saved(model, c, tmp_path / "spec")
    aux, ids = par.inputs(c)
    rng = np.random.default_rng(7)
    mask = rng.random(len(ids)) < 0.75
    hidden = rng.standard_normal((len(ids), c["hidden"])).astype(np.float32)
    anchors, valid = np.asarray(par.ANCHORS), np.ones(len(par.ANCHORS), bool)
    loss_config = {"kl_div": (eager.kl_div_loss, 1.0)}
    want, _ = speculators_loss(model, torch, core, loss_config, aux, ids, mask, hidden, anchors, valid, monkeypatch)
    with torch.no_grad():
        y = model.verifier_norm(torch.as_tensor(hidden)).numpy()
    head_w = jnp.asarray(model.verifier_lm_head.weight.detach().numpy())
    args = (jnp.asarray(aux), jnp.asarray(y), head_w, ids, mask, anchors, valid, 0.0)
    got, _ = our_loss(drafter, *args, attention="kernels")
    assert want > 0 and abs(got - want) <= 1e-5 * abs(want), (head, got, want)


def test_kernels_give_the_dense_gradients_of_a_causal_window():
    """The causal path (two attentions merged) differentiates like the dense masks."""
    from train.blocks import block_loss_and_metrics
    from train.spec import LossSpec
    from train.step import split_params

    cfg = pj.DrafterConfig(
        hidden_size=32, target_hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=64, draft_vocab_size=64, mode="dflash", mask_token_id=62,
        aux_layer_ids=(1, 2), qk_norm=True, block_size=4, layer_types=(S, F), sliding_window=WINDOW,
    )  # fmt: skip
    parts, params, frozen = split_params(pj.Drafter.random(cfg, seed=3), True, True)
    rng = np.random.default_rng(0)
    length = 20
    batch = {
        "tokens": jnp.asarray(rng.integers(0, 62, (2, length)), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (2, length)),
        "sup": jnp.asarray(rng.random((2, length)) < 0.8),
        "doc": jnp.asarray([[0] * 12 + [1] * 8, [0] * 20], jnp.int32),
        "anchor": jnp.asarray([[1, 5, 9, 13], [2, 3, 11, 0]], jnp.int32),
        "anchor_valid": jnp.asarray([[True] * 4, [True, True, True, False]]),
    }
    aux = jnp.asarray(rng.standard_normal((2, length, 64)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((2, length, 32)), jnp.float32)
    head_w = jnp.asarray(rng.standard_normal((64, 32)) / 6, jnp.float32)

    def loss(p, attention):
        spec = LossSpec(mode="dflash", dflash_gamma=4.0, ce_weight=0.0, softcap=None, attention=attention)
        return block_loss_and_metrics(parts, p, frozen, aux, y, head_w, batch, spec)[0]

    dense, g_dense = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, "dense")
    blocked, g_blocked = jax.jit(jax.value_and_grad(loss), static_argnums=1)(params, "kernels")
    assert float(blocked) == pytest.approx(float(dense), rel=1e-5)
    for name in g_dense:
        np.testing.assert_allclose(g_blocked[name], g_dense[name], rtol=2e-4, atol=1e-6, err_msg=name)
    assert any(float(jnp.abs(g).max()) > 0 for g in g_dense.values())


# ---------------------------------------------------------------------------------------
# the engine
NEW, BLOCK = 12, 4


@pytest.fixture(scope="module")
def qwen3(built):
    folder, hf = built("qwen3")
    return hf, pj.load_target(folder, dtype="float32", aux_layer_ids=(0, 1, 2))


def window_head(target, head: str, seed: int = 3) -> Drafter:
    types, non_causal = HEADS[head]
    kw = dict(sliding_window=WINDOW, layer_types=types, sliding_window_non_causal=non_causal)
    return pj.new_drafter(target, num_layers=2, mode="dflash", block_size=BLOCK, seed=seed, **kw)


def _prompts(batch: int, seed: int, shortest: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, hf_tiny.VOCAB, size=int(n)).tolist() for n in rng.integers(shortest, 12, size=batch)]


@pytest.mark.parametrize("head", list(HEADS))
def test_lossless_greedy_with_a_window(qwen3, head):
    hf, target = qwen3
    prompts = _prompts(4, seed=1)
    want = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
        want.append(out[0, len(p) :].tolist())
    res = SpeculativeDecoder(target, window_head(target, head), k=BLOCK - 1).generate(prompts, max_new_tokens=NEW)
    assert res.tokens == want
    assert 1.0 <= res.stats["acceptance_length"] <= BLOCK


@pytest.mark.parametrize("head", ["hybrid-causal", "hybrid-bidirectional"])
def test_the_cached_round_with_a_window_equals_the_block(qwen3, head):
    """The engine's cache read through a window (positions past the prompt, stale rows of
    rejected drafts) gives the no-cache block's logits over the whole sequence."""
    _, target = qwen3
    d = window_head(target, head, seed=7)
    k = BLOCK - 1
    dec = SpeculativeDecoder(target, d, k=k, eos_ids=())
    cfg, ids, state = dec.start(_prompts(3, seed=5, shortest=WINDOW + 2), max_new_tokens=30)
    rows = len(ids)
    for step in range(3):
        length, out, out_len = jax.device_get((state.length, state.out, state.out_len))
        seqs = [prompt + out[row, : out_len[row]].tolist() for row, prompt in enumerate(ids)]
        assert min(len(s) for s in seqs) > WINDOW + 1  # the window hides context rows
        want = reference_logits(target, d, seqs, k)
        got = cached_block_logits(d.state, state.last, state.length, state.drafter_cache, head_def=d.graphdef)
        np.testing.assert_allclose(np.asarray(got)[:rows, 1 : k + 1], want, atol=2e-4, err_msg=f"step {step}")
        state = sp.jit_round(cfg, *dec.modules(), state)
    full = Drafter.from_arrays(dataclasses.replace(d.config, layer_types=(F, F)), d.arrays())
    assert np.abs(reference_logits(target, full, seqs, k) - want).max() > 1e-3  # the window mattered


@pytest.mark.parametrize("non_causal", [False])  # speculators' default; the ring is the same for True
def test_an_all_sliding_head_keeps_a_ring_that_reads_as_the_whole_context(qwen3, non_causal):
    """Every layer slides: the drafter's context cache is a ring of 64 slots (`drafter_length`:
    the window and a round, rounded up) beside the target's 128, the sequences run past it, and
    each round's block over the ring gives the no-cache block's logits over the whole sequence
    (stale rows of rejected drafts included); greedy decoding stays lossless."""
    hf, target = qwen3
    kw = dict(sliding_window=WINDOW, layer_types=(S, S), sliding_window_non_causal=non_causal)
    d = pj.new_drafter(target, num_layers=2, mode="dflash", block_size=BLOCK, seed=5, **kw)
    k = BLOCK - 1
    dec = SpeculativeDecoder(target, d, k=k, eos_ids=())
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, hf_tiny.VOCAB, size=int(n)).tolist() for n in (66, 71, 80)]
    cfg, ids, state = dec.start(prompts, max_new_tokens=40)  # every prompt is longer than the ring
    assert state.drafter_cache[0][0].shape[1] == 64 < state.target_cache[0][0].shape[1]
    for step in range(4):
        out, out_len = jax.device_get((state.out, state.out_len))
        seqs = [prompt + out[row, : out_len[row]].tolist() for row, prompt in enumerate(ids)]
        want = reference_logits(target, d, seqs, k, pad=128)
        got = cached_block_logits(d.state, state.last, state.length, state.drafter_cache, head_def=d.graphdef)
        np.testing.assert_allclose(np.asarray(got)[: len(ids), 1 : k + 1], want, atol=2e-4, err_msg=f"step {step}")
        state = sp.jit_round(cfg, *dec.modules(), state)
    res = dec.generate(prompts[:2], max_new_tokens=NEW)
    for p, got in zip(prompts[:2], res.tokens):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
        assert got == ref[0, len(p) :].tolist()


# ---------------------------------------------------------------------------------------
# formats
def _head(head: str) -> Drafter:
    types, non_causal = HEADS[head]
    cfg = pj.DrafterConfig(
        hidden_size=32, target_hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
        intermediate_size=48, vocab_size=64, draft_vocab_size=64, mode="dflash", mask_token_id=62,
        aux_layer_ids=(2, 5), qk_norm=True, block_size=4, layer_types=types, sliding_window=WINDOW,
        sliding_window_non_causal=non_causal,
    )  # fmt: skip
    return Drafter.random(cfg, seed=1)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
@pytest.mark.parametrize("head", list(HEADS))
def test_export_import_round_trip(head, fmt, tmp_path):
    """layer_types, sliding_window and the causality key come back; speculators' single key
    cannot say "causal sliding layers beside bidirectional full ones" to vLLM: refused."""
    d = _head(head)
    export = {"vllm": export_vllm, "speculators": export_speculators}[fmt]
    if fmt == "speculators" and head == "hybrid-causal":
        with pytest.raises(ConfigError, match="export --format vllm"):
            export(d, tmp_path / "h", "float32")
        return
    folder = export(d, tmp_path / "h", "float32")
    raw = json.loads((folder / "config.json").read_text())
    layer = raw["transformer_layer_config"] if fmt == "speculators" else raw
    assert (layer["layer_types"], layer["sliding_window"]) == (list(d.config.layer_types), WINDOW)
    assert inspect_folder(folder)["problems"] == []  # the lint reads the keys as the head means them
    a = d.arrays()
    verifier = (a[("embed_tokens", "embedding")], a[("lm_head", "kernel")].T)  # speculators leaves them out
    cfg, arrays, _ = read_drafter(folder, target_weights=lambda: verifier)
    assert cfg == d.config
    assert all(np.array_equal(arrays[p], x) for p, x in a.items())
    assert pj.load_drafter(d.save(tmp_path / "own")).config == d.config  # our own format too


def test_config_checks():
    cfg = _head("hybrid-causal").config
    assert [cfg.block_causal(i) for i in range(2)] == [True, False]
    assert not any(_head("hybrid-bidirectional").config.block_causal(i) for i in range(2))
    chain = dict(mode="chain", block_size=None, aux_layer_ids=(1, 2, 3))
    dataclasses.replace(cfg, **chain)  # an EAGLE-3 head with the same windows is fine
    with pytest.raises(ConfigError, match="sliding_window_non_causal is a DFlash setting"):
        dataclasses.replace(cfg, **chain, sliding_window_non_causal=True)
