"""The engine's DFlash mode: lossless greedy on every target family, an agreeing head's long
accepted runs, the cached round equal to the no-cache block computation, lossless sampling,
one drafter pass per round, and the k bounds of a block."""

from __future__ import annotations

import functools

import hf_tiny
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from sampling_law import chi2_pvalue, sample_counts

import peagle_jax as pj
from peagle_jax.engine import SpeculativeDecoder, sampler
from peagle_jax.engine import speculative as sp
from peagle_jax.models import dflash as dflash_mod
from peagle_jax.models.layers import apply_rope

AUX = (0, 1, 2)
NEW = 12
BLOCK = 4
FAMILIES = ("llama-gqa2-tied-llama3", "qwen3", "gemma3", "qwen3_moe", "gpt_oss")


@pytest.fixture(scope="module")
def targets(built):
    """kind -> (HF torch model, Target)."""
    loaded = {}

    def get(kind):
        if kind not in loaded:
            folder, hf = built(kind)
            loaded[kind] = (hf, pj.load_target(folder, dtype="float32", aux_layer_ids=AUX))
        return loaded[kind]

    return get


def _prompts(batch: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, hf_tiny.VOCAB, size=int(n)).tolist() for n in rng.integers(3, 12, size=batch)]


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _random_head(target, seed: int = 3):
    return pj.new_drafter(target, num_layers=2, mode="dflash", block_size=BLOCK, seed=seed)


@pytest.mark.parametrize("kind", FAMILIES)
def test_lossless_greedy_on_every_family(targets, kind):
    """Plain greedy is Hugging Face's here (the engine's mode "none" equals it: test_speculative
    and test_moe), which saves a compile per family."""
    hf, target = targets(kind)
    prompts = _prompts(4, seed=1)  # ragged: rows at different positions every round
    want = [_hf_greedy(hf, p, NEW) for p in prompts]
    ks = (BLOCK - 1, 1) if kind == "qwen3" else (BLOCK - 1,)  # k < B - 1: the first k slots of a full block
    for k in ks:
        res = SpeculativeDecoder(target, _random_head(target), k=k).generate(prompts, max_new_tokens=NEW)
        assert res.tokens == want, k
        assert 1.0 <= res.stats["acceptance_length"] <= k + 1


# ---------------------------------------------------------------- an agreeing head


def _unit_rows(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _successor_target(folder, sharpness: float):
    """A tiny Llama whose likeliest next token is x + 1 (mod V): its layers add nothing, so
    every aux state is the embedding e_x, whose dimension 0 is 1 for every token (a constant
    a head can key on); lm_head row y is sharpness * unit(e_{y-1}) without that dimension."""
    hf = hf_tiny.build("llama-mha-untied", seed=5)
    with torch.no_grad():
        emb = hf.model.embed_tokens.weight
        emb[:, 0] = 1.0
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hf.model.norm.weight.fill_(1.0)
        rest = emb.numpy().copy()
        rest[:, 0] = 0.0
        hf.lm_head.weight.copy_(torch.from_numpy(sharpness * _unit_rows(np.roll(rest, 1, axis=0))))
    hf.save_pretrained(str(folder))
    return pj.load_target(folder, dtype="float32", aux_layer_ids=AUX)


@pytest.fixture(scope="module")
def successor(tmp_path_factory):
    return _successor_target(tmp_path_factory.mktemp("successor"), 10.0)


def _rope_offset_keys(rope, head_dim: int, offset: int):
    """(q0, k0) [head_dim]: constant query and key vectors whose RoPE score peaks where the key
    sits `offset` positions before the query (energy on the 4 fastest frequency pairs, weights
    that keep every other offset in -8..80 at least 0.26 of the peak below it)."""
    k0 = np.zeros(head_dim, np.float32)
    k0[:4] = np.sqrt([0.549, 0.157, 0.172, 0.122])
    q0 = apply_rope(jnp.asarray(k0)[None, None, None], jnp.asarray([[-offset]]), rope)[0, 0, 0]
    return np.asarray(q0), k0


def _copy_back_head(target):
    """A 1-layer DFlash head that drafts the successor target's tokens exactly: block slot k (at
    position p + k) attends the context row at p + k - B alone (RoPE, see `_rope_offset_keys`),
    copies its token's embedding, and lm_head maps token t to t + B. Every draft is right once
    B tokens of a successor run are in the context, so a round accepts all K drafts."""
    d = pj.new_drafter(target, num_layers=1, mode="dflash", block_size=BLOCK, seed=2)
    cfg = d.config
    h, hd = cfg.hidden_size, cfg.head_dim
    state = nnx.to_pure_dict(d.state)
    emb = np.array(state["embed_tokens"]["embedding"])
    rest = emb.copy()
    rest[:, 0] = 0.0
    emb[cfg.mask_token_id] = np.eye(h)[0]  # the mask row: only the constant dimension
    q0, k0 = _rope_offset_keys(cfg.rope, hd, BLOCK)
    attn = state["layers"][0]["self_attn"]
    q_kernel = np.zeros((h, cfg.num_heads * hd), np.float32)
    q_kernel[0] = np.tile(q0, cfg.num_heads)
    k_kernel = np.zeros((h, cfg.num_kv_heads * hd), np.float32)
    k_kernel[0] = np.tile(k0, cfg.num_kv_heads)
    v_kernel = np.eye(h, cfg.num_kv_heads * hd, dtype=np.float32)
    v_kernel[0] = 0.0  # values carry the token, not the constant
    new = {
        ("embed_tokens", "embedding"): emb,
        ("fc", "kernel"): np.eye(h, dtype=np.float32),
        ("lm_head", "kernel"): _unit_rows(np.roll(rest, BLOCK, axis=0)).T,
    }
    attn["q_proj"]["kernel"], attn["k_proj"]["kernel"], attn["v_proj"]["kernel"] = q_kernel, k_kernel, v_kernel
    attn["o_proj"]["kernel"] = np.eye(cfg.num_heads * hd, h, dtype=np.float32)
    attn["q_norm"]["weight"] = np.full((hd,), 15.0, np.float32)  # peak score 60: one key wins
    attn["k_norm"]["weight"] = np.ones((hd,), np.float32)
    layer = state["layers"][0]
    layer["mlp"]["down_proj"]["kernel"] = np.zeros_like(layer["mlp"]["down_proj"]["kernel"])
    for norm in (layer["input_layernorm"], layer["post_attention_layernorm"], state["hidden_norm"], state["norm"]):
        norm["weight"] = np.ones_like(norm["weight"])
    for (a, b), x in new.items():
        state[a][b] = x
    nnx.replace_by_pure_dict(d.state, jax.tree.map(jnp.asarray, state))
    return d


def _runs(lengths, seed: int) -> list[list[int]]:
    """Ragged prompts that are successor runs (s, s+1, ...): the copy-back head is right at once."""
    starts = np.random.default_rng(seed).integers(0, hf_tiny.VOCAB, len(lengths))
    return [[(int(s) + i) % hf_tiny.VOCAB for i in range(n)] for s, n in zip(starts, lengths)]


def test_an_agreeing_head_has_its_whole_block_accepted(successor):
    target = successor
    prompts = _runs((5, 9, 4, 7), seed=2)
    plain = SpeculativeDecoder(target, mode="none").generate(prompts, max_new_tokens=NEW)
    assert plain.tokens[0] == [(prompts[0][-1] + 1 + i) % hf_tiny.VOCAB for i in range(NEW)]
    k = BLOCK - 1
    res = SpeculativeDecoder(target, _copy_back_head(target), k=k).generate(prompts, max_new_tokens=NEW)
    assert res.tokens == plain.tokens
    # every draft of every round: the context rows the block reads (p - 3 .. p - 1) are the
    # previous rounds' accepted tokens, so their cache writes are right too
    assert res.stats["per_position_acceptance"] == [1.0] * k, res.stats
    assert res.stats["acceptance_length"] == k + 1


# ---------------------------------------------------------------- the round against a direct computation


PAD = 64  # reference sequences are right-padded to one length: one compile


@functools.partial(jax.jit, static_argnames=("target_def", "head_def", "aux_layer_ids"))
def block_logits(target_state, head_state, tokens, lengths, *, target_def, head_def, aux_layer_ids):
    """Logits [R, B, Vd] of the block anchored at the last real token of each row of `tokens`
    [R, PAD] (right-padded), the whole row run through the target and `block_rows_states`
    without any cache."""
    rows, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width), (rows, width))
    out = nnx.merge(target_def, target_state)(tokens, positions, None, aux_layer_ids=aux_layer_ids)
    doc = jnp.where(positions < lengths[:, None], 0, -1)
    anchors = (lengths - 1)[:, None]
    head = nnx.merge(head_def, head_state)
    block = dflash_mod.block_rows_states(head, tokens, out.aux_hidden, positions, doc, anchors, anchors >= 0)
    return block.logits


def reference_logits(target, head, seqs: list[list[int]], k: int, pad: int = PAD) -> np.ndarray:
    """[R, k, Vd] logits of the k draft slots of `block_logits` (sequences right-padded to `pad`)."""
    tokens = np.zeros((len(seqs), pad), np.int32)
    for i, seq in enumerate(seqs):
        tokens[i, : len(seq)] = seq
    logits = block_logits(
        target.state,
        head.state,
        jnp.asarray(tokens),
        jnp.asarray([len(s) for s in seqs]),
        target_def=target.graphdef,
        head_def=head.graphdef,
        aux_layer_ids=head.config.aux_layer_ids,
    )
    return np.asarray(logits)[:, 1 : k + 1]


@functools.partial(jax.jit, static_argnames=("head_def",))
def cached_block_logits(head_state, bonus, anchor, cache, *, head_def):
    return nnx.merge(head_def, head_state).draft_block(bonus, anchor, cache).logits


def test_the_cached_round_equals_the_block_over_the_whole_context(targets):
    """After prefill and after rounds (rejected drafts leave stale cache rows): the engine's
    drafter cache read by `draft_block` gives the logits of the no-cache computation over the
    whole sequence, and the engine's drafts are their argmax."""
    _, target = targets("gemma3")
    head = _random_head(target, seed=7)
    k = BLOCK - 1
    dec = SpeculativeDecoder(target, head, k=k, eos_ids=())
    cfg, ids, state = dec.start(_prompts(3, seed=5), max_new_tokens=40)
    rows = len(ids)
    for step in range(4):
        length, out, out_len, drafts = jax.device_get((state.length, state.out, state.out_len, state.drafts))
        seqs = [prompt + out[row, : out_len[row]].tolist() for row, prompt in enumerate(ids)]
        assert [len(s) for s in seqs] == (length[:rows] + 1).tolist()
        want = reference_logits(target, head, seqs, k)
        got = cached_block_logits(head.state, state.last, state.length, state.drafter_cache, head_def=head.graphdef)
        np.testing.assert_allclose(np.asarray(got)[:rows, 1 : k + 1], want, atol=2e-4, err_msg=f"step {step}")
        ids_want = want.argmax(-1)
        top2 = np.sort(want, axis=-1)[..., -2:]
        sure = top2[..., 1] - top2[..., 0] > 1e-3  # a near tie may flip between two float paths
        np.testing.assert_array_equal(drafts[:rows][sure], (ids_want + head.d2t[ids_want])[sure])
        assert sure.mean() > 0.8
        state = sp.jit_round(cfg, *dec.modules(), state)


# ---------------------------------------------------------------- sampling, passes, bad input


def test_lossless_sampling_chi_square_and_a_wrong_rule_fails(tmp_path, monkeypatch):
    """Joint law of the first three sampled tokens (temperature 1, top-p 0.9) with a head that is
    often right: equal to plain sampling, and resampling from p instead of the residual after a
    rejection is caught by the same test."""
    target = _successor_target(tmp_path, 0.6)
    prompt = [7, 8, 9]
    plain = SpeculativeDecoder(target, mode="none")
    spec = SpeculativeDecoder(target, _copy_back_head(target), k=2)
    new, rows, seeds = 3, 512, range(4)  # 512 rows: 256 leave a wrong rule near p ~ 1e-4
    base = sample_counts(plain, prompt, rows, seeds, new)
    good = sample_counts(spec, prompt, rows, [s + 100 for s in seeds], new)
    assert chi2_pvalue(base, good) > 1e-3
    right = sampler.accept_rejection

    def wrong(probs, drafts, draft_probs, key):
        n, _ = right(probs, drafts, draft_probs, key)
        pick = jnp.take_along_axis(probs, n[:, None, None], axis=1)[:, 0]
        return n, jax.random.categorical(key, jnp.log(pick), axis=-1).astype(jnp.int32)

    monkeypatch.setattr(sampler, "accept_rejection", wrong)
    jax.clear_caches()
    bad = sample_counts(spec, prompt, rows, [s + 100 for s in seeds], new)
    assert chi2_pvalue(base, bad) < 1e-6


def test_a_round_runs_one_drafter_forward(targets, monkeypatch):
    _, target = targets("llama-gqa2-tied-llama3")
    calls = {"n": 0}
    original = dflash_mod.DFlashModel.__call__

    def counting(self, *a, **kw):
        calls["n"] += 1
        return original(self, *a, **kw)

    monkeypatch.setattr(dflash_mod.DFlashModel, "__call__", counting)
    dec = SpeculativeDecoder(target, _random_head(target), k=BLOCK - 1)
    jax.clear_caches()  # trace the prefill afresh, not a cached compile
    cfg, _, state = dec.start(_prompts(1), max_new_tokens=8)
    assert calls["n"] == 1  # prefill: one block pass
    tdef, tstate, ddef, dstate = dec.modules()
    calls["n"] = 0
    jax.make_jaxpr(lambda s: sp.decode_round(cfg, nnx.merge(tdef, tstate), nnx.merge(ddef, dstate), s))(state)
    assert calls["n"] == 1


def test_modes_and_k_bounds_are_checked(targets):
    _, target = targets("llama-gqa2-tied-llama3")
    head = _random_head(target)
    assert SpeculativeDecoder(target, head, k=2).mode == "dflash"  # the head's own mode by default
    assert SpeculativeDecoder(target, pj.new_drafter(target), k=2).mode == "parallel"
    with pytest.raises(ValueError, match="block_size 4 gives at most k=3"):
        SpeculativeDecoder(target, head, k=BLOCK)
    with pytest.raises(ValueError, match="cannot draft in mode 'parallel'"):
        SpeculativeDecoder(target, head, k=2, mode="parallel")
    with pytest.raises(ValueError, match="cannot draft in mode 'dflash'"):
        SpeculativeDecoder(target, pj.new_drafter(target), k=2, mode="dflash")
    with pytest.raises(ValueError, match="drafts 1 to 3 tokens a pass"):  # the engine's own guard
        sp.draft_dflash(head.model, None, None, None, None, BLOCK, None)
