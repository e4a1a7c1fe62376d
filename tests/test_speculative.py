"""The speculative engine: lossless greedy and sampling, one drafter pass, the slot layout."""

from __future__ import annotations

import hf_tiny
import numpy as np
import pytest
import torch
from sampling_law import chi2_pvalue, sample_counts

import peagle_jax as pj
from infer import SpeculativeDecoder
from peagle_jax.engine import sampler
from peagle_jax.engine import speculative as sp
from peagle_jax.models import eagle as drafter_mod

AUX = (0, 1, 2)
NEW = 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (HF torch model, Target) for one tiny model per family."""
    out = {}
    for kind in ("llama-gqa2-tied-llama3", "qwen3", "gemma3"):
        folder = tmp_path_factory.mktemp(kind)
        hf = hf_tiny.build(kind, folder)
        out[kind] = (hf, pj.load_target(folder, dtype="float32", aux_layer_ids=AUX))
    return out


def _prompts(batch: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, hf_tiny.VOCAB, size=int(n)).tolist() for n in rng.integers(3, 12, size=batch)]


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", ["llama-gqa2-tied-llama3", "qwen3", "gemma3"])
def test_lossless_greedy_matches_plain_and_transformers(models, kind):
    hf, target = models[kind]
    prompts = _prompts(4, seed=1)
    plain = SpeculativeDecoder(target, mode="none").generate(prompts, max_new_tokens=NEW)
    assert plain.tokens == [_hf_greedy(hf, p, NEW) for p in prompts]
    # random drafters (K 1 and 7 of both modes with an agreeing drafter below): a few K on one family,
    # the others (same drafter code, other target layers) at one K per mode
    ks = {"parallel": (1, 3), "chain": (7,)} if kind.startswith("llama") else {"parallel": (7,), "chain": (3,)}
    for mode in ("parallel", "chain"):
        drafter = pj.new_drafter(target, num_layers=1, mode=mode, seed=3)
        for k in ks[mode]:
            res = SpeculativeDecoder(target, drafter, k=k, mode=mode).generate(prompts, max_new_tokens=NEW)
            assert res.tokens == plain.tokens, (mode, k)
            assert 1.0 <= res.stats["acceptance_length"] <= k + 1


def _agreeing_drafter(target, plain_tokens, mode):
    """A random drafter whose draft vocabulary is two tokens the target emits."""
    used = np.unique(np.concatenate([np.asarray(t) for t in plain_tokens]))[:2]
    return pj.new_drafter(target, num_layers=1, mode=mode, seed=1, draft_vocab=used)


def _unit_rows(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _successor_target(folder, sharpness: float):
    """(HF model, Target) of a tiny Llama whose likeliest next token is x + 1 (mod V): every
    layer's output projections are zero, so the residual stream stays the embedding e_x, and
    lm_head row y is sharpness * unit(e_{y-1}). sharpness 10: greedy is certain; 0.6: about
    half the mass on x + 1 (for sampling tests)."""
    hf = hf_tiny.build("llama-mha-untied", seed=5)
    with torch.no_grad():
        emb = hf.model.embed_tokens.weight
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hf.model.norm.weight.fill_(1.0)
        hf.lm_head.weight.copy_(torch.from_numpy(sharpness * _unit_rows(np.roll(emb.numpy(), 1, axis=0))))
    hf.save_pretrained(str(folder))
    return hf, pj.load_target(folder, dtype="float32", aux_layer_ids=AUX)


@pytest.fixture(scope="module")
def successor(tmp_path_factory):
    return _successor_target(tmp_path_factory.mktemp("successor"), 10.0)


def _skip_ahead_drafter(target, mode, num_layers=1):
    """A drafter built from the target's own weights that predicts x + 2 from the aux state
    of x: fc copies the first aux chunk (= e_x), its layers add nothing, lm_head row y is
    e_{y-2}. Its first draft is right; mask slots / later chain steps mostly are not."""
    import jax.numpy as jnp
    from flax import nnx

    d = pj.new_drafter(target, num_layers=num_layers, mode=mode, seed=2)
    emb = np.asarray(nnx.merge(target.graphdef, target.state).embed_tokens.embedding[...])
    state = nnx.to_pure_dict(d.state)
    h = emb.shape[1]
    state["fc"]["kernel"] = jnp.asarray(np.concatenate([np.eye(h), np.zeros((2 * h, h))]), jnp.float32)
    for layer in state["layers"].values():
        layer["self_attn"]["o_proj"]["kernel"] = jnp.zeros_like(layer["self_attn"]["o_proj"]["kernel"])
        layer["mlp"]["down_proj"]["kernel"] = jnp.zeros_like(layer["mlp"]["down_proj"]["kernel"])
    state["norm"]["weight"] = jnp.ones_like(state["norm"]["weight"])
    state["lm_head"]["kernel"] = jnp.asarray(10 * _unit_rows(np.roll(emb, 2, axis=0)).T)
    nnx.replace_by_pure_dict(d.state, state)
    return d


@pytest.mark.parametrize("mode", ["parallel", "chain"])
def test_lossless_greedy_with_an_agreeing_drafter_batch1_and_4(successor, mode):
    hf, target = successor
    prompts = _prompts(4, seed=2)
    plain = SpeculativeDecoder(target, mode="none").generate(prompts, max_new_tokens=NEW)
    assert plain.tokens[0] == [(prompts[0][-1] + 1 + i) % hf_tiny.VOCAB for i in range(NEW)]
    assert plain.tokens[0] == _hf_greedy(hf, prompts[0], NEW)
    drafter = _skip_ahead_drafter(target, mode)
    for k in (1, 7):  # K = 3 with a random drafter: test_lossless_greedy_matches_plain_and_transformers
        dec = SpeculativeDecoder(target, drafter, k=k, mode=mode)
        res = dec.generate(prompts, max_new_tokens=NEW)
        assert res.tokens == plain.tokens, k
        assert res.stats["per_position_acceptance"][0] > 0.9, res.stats  # the accept path really ran
        single = dec.generate(prompts[:1], max_new_tokens=NEW)
        assert single.tokens == plain.tokens[:1]


def test_eos_stops_each_row_and_matches_plain(models):
    _, target = models["qwen3"]
    prompts = _prompts(4, seed=4)
    plain = SpeculativeDecoder(target, mode="none").generate(prompts, max_new_tokens=NEW)
    eos = plain.tokens[0][5]  # a token the first row emits mid-way
    target_eos = _with_eos(target, eos)
    drafter = _agreeing_drafter(target, plain.tokens, "parallel")
    want = [row[: row.index(eos) + 1] if eos in row else row for row in plain.tokens]
    for mode, d in (("none", None), ("parallel", drafter)):
        res = SpeculativeDecoder(target_eos, d, k=3, mode=mode).generate(prompts, max_new_tokens=NEW)
        assert res.tokens == want, mode


def _with_eos(target, eos):
    import copy
    import dataclasses

    t = copy.copy(target)
    t.config = dataclasses.replace(target.config, eos_token_id=(int(eos),))
    return t


def test_parallel_round_runs_one_drafter_forward(models, monkeypatch):
    _, target = models["llama-gqa2-tied-llama3"]
    calls = {"n": 0}
    original = drafter_mod.DrafterModel.__call__

    def counting(self, *a, **kw):
        calls["n"] += 1
        return original(self, *a, **kw)

    monkeypatch.setattr(drafter_mod.DrafterModel, "__call__", counting)
    counts = {}
    for mode in ("parallel", "chain"):
        dec = SpeculativeDecoder(target, pj.new_drafter(target, mode=mode), k=7, mode=mode)
        cfg, _, state = dec.start(_prompts(1), max_new_tokens=8)
        tdef, tstate, ddef, dstate = dec.modules()
        calls["n"] = 0
        import jax

        jax.make_jaxpr(lambda s: sp.decode_round(cfg, sp.nnx.merge(tdef, tstate), sp.nnx.merge(ddef, dstate), s))(state)
        counts[mode] = calls["n"]
    assert counts["parallel"] == 1  # P-EAGLE: one pass drafts all K
    assert counts["chain"] == 2  # EAGLE-3: the accepted slots, then a scanned single-token step


def test_propose_equals_the_dense_slot_formula(models):
    """propose = target prefill -> bonus b -> ONE pass over [prompt[1:], b, mask x (K-1)] at
    positions 0..P+K-2 with plain causal attention, computed here without any cache."""
    import jax.numpy as jnp

    _, target = models["gemma3"]
    k = 5
    drafter = pj.new_drafter(target, num_layers=2, mode="parallel", seed=7, draft_vocab=np.arange(0, 96, 2))
    prompt = _prompts(1, seed=5)[0]
    got = SpeculativeDecoder(target, drafter, k=k).propose(prompt)

    out = target.forward(np.asarray([prompt]))
    bonus = int(np.argmax(np.asarray(out.logits)[0, -1]))
    model = drafter.model
    p = len(prompt)
    tokens = jnp.asarray([prompt[1:] + [bonus] + [drafter.config.mask_token_id] * (k - 1)])
    g = jnp.concatenate(
        [model.fuse(out.aux_hidden), jnp.broadcast_to(model.mask_g(), (1, k - 1, model.config.hidden_size))], axis=1
    )
    positions = jnp.arange(p + k - 1)[None, :]
    logits = np.asarray(model(tokens, g, positions).logits)[0, p - 1 :]
    ids = logits.argmax(-1)
    want = [bonus, *(ids + np.asarray(drafter.d2t)[ids]).tolist()]
    assert got == want


def test_lossless_sampling_chi_square_and_a_wrong_rule_fails(tmp_path, monkeypatch):
    """Joint law of the first two sampled tokens (temperature 1, top-p 0.9): speculative
    sampling with a drafter that is often right equals plain sampling, and resampling from p
    instead of norm(max(0, p - q)) after a rejection is caught by the same test."""
    import jax

    _, target = _successor_target(tmp_path, 0.6)
    prompt = [7, 3, 9]
    plain = SpeculativeDecoder(target, mode="none")
    spec = SpeculativeDecoder(target, _skip_ahead_drafter(target, "parallel"), k=2, mode="parallel")
    new, rows, seeds = 2, 512, range(4)  # 512 rows: a wrong rule scores p ~ 1e-14, 256 only ~ 1e-5
    base = sample_counts(plain, prompt, rows, seeds, new)
    good = sample_counts(spec, prompt, rows, [s + 100 for s in seeds], new)
    assert chi2_pvalue(base, good) > 1e-3
    right = sampler.accept_rejection

    def wrong(probs, drafts, draft_probs, key):  # resamples from p instead of the residual
        n, _ = right(probs, drafts, draft_probs, key)
        pick = jax.numpy.take_along_axis(probs, n[:, None, None], axis=1)[:, 0]
        return n, jax.random.categorical(key, jax.numpy.log(pick), axis=-1).astype(jax.numpy.int32)

    monkeypatch.setattr(sampler, "accept_rejection", wrong)
    jax.clear_caches()
    bad = sample_counts(spec, prompt, rows, [s + 100 for s in seeds], new)
    assert chi2_pvalue(base, bad) < 1e-6


def test_bad_input_is_refused_clearly(models):
    _, target = models["llama-gqa2-tied-llama3"]
    drafter = pj.new_drafter(target, mode="parallel", k_train=4)
    with pytest.raises(ValueError, match="trained depth"):
        SpeculativeDecoder(target, drafter, k=7)
    with pytest.warns(UserWarning, match="trained depth"):
        SpeculativeDecoder(target, drafter, k=7, deep_k="warn")
    dec = SpeculativeDecoder(target, drafter, k=3, cache_len=32)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        dec.generate([[1] * 20], max_new_tokens=8)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        dec.generate([[1, 2], []], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompt 0: token id 96 outside the target's vocabulary \[0, 96\)"):
        dec.generate([[1, 96]], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"stop_token_ids: token id -1 outside the target's vocabulary \[0, 96\)"):
        dec.generate([[1, 2]], max_new_tokens=4, stop_token_ids=[5, -1])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        SpeculativeDecoder(target, drafter, k=3).generate([[1] * 100], max_new_tokens=64)
    _, other = models["gemma3"]
    foreign = pj.new_drafter(other, mode="parallel")
    import dataclasses

    foreign.config = dataclasses.replace(foreign.config, target_hidden_size=32)
    with pytest.raises(ValueError, match="hidden size"):
        SpeculativeDecoder(target, foreign, k=3)
    foreign.config = dataclasses.replace(foreign.config, target_hidden_size=64, vocab_size=128)
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeDecoder(target, foreign, k=3)


def test_no_recompile_across_calls_in_one_bucket(models, monkeypatch):
    """One compile per (batch bucket, cache length, K): new prompts of other lengths and
    other token budgets in the same buckets reuse the compiled prefill and loop (counted as
    traces of the engine's prefill and round)."""
    traces = []
    for name in ("prefill", "decode_round"):
        original = getattr(sp, name)
        monkeypatch.setattr(sp, name, lambda *a, _f=original, _n=name: traces.append(_n) or _f(*a))
    _, target = models["llama-gqa2-tied-llama3"]
    # eos ids no other test uses (outside the vocabulary: never emitted): a static engine
    # setting, so the first call must compile
    dec = SpeculativeDecoder(target, pj.new_drafter(target, mode="parallel", seed=2), k=3, eos_ids=(1000, 1001))
    first = dec.generate(_prompts(3, seed=8), max_new_tokens=10)
    assert set(traces) == {"prefill", "decode_round"}  # the counter sees compiles
    traces.clear()
    again = dec.generate(_prompts(4, seed=9), max_new_tokens=14)
    assert traces == []
    assert [len(t) for t in first.tokens] == [10] * 3
    assert [len(t) for t in again.tokens] == [14] * 4


def test_drafter_aux_ids_decide_and_are_reported():
    """The drafter's aux ids are used whatever the target was loaded with (they are what the head
    was trained on), res.stats says so, and ids the target cannot capture are an error."""
    import dataclasses

    from paths import VECTORS

    target = pj.load_target(VECTORS / "target", dtype="float32", aux_layer_ids=(0, 1, 2))  # 8 layers
    drafter = pj.new_drafter(target, mode="parallel", seed=5)
    drafter.config = dataclasses.replace(drafter.config, aux_layer_ids=(5, 2, 4))  # any order: layer order
    prompts = _prompts(2, seed=11)
    res = SpeculativeDecoder(target, drafter, k=3).generate(prompts, max_new_tokens=6)
    assert res.stats["aux_layer_ids"] == [2, 4, 5]
    assert res.stats["aux_layer_ids_from"] == "drafter"
    same_ids = pj.load_target(VECTORS / "target", dtype="float32", aux_layer_ids=(2, 4, 5))
    ref = SpeculativeDecoder(same_ids, drafter, k=3)
    dec = SpeculativeDecoder(target, drafter, k=3)
    assert [dec.propose(p) for p in prompts] == [ref.propose(p) for p in prompts]
    other = SpeculativeDecoder(target, pj.new_drafter(target, mode="parallel", seed=5), k=3)
    assert [other.propose(p) for p in prompts] != [ref.propose(p) for p in prompts]  # the ids matter
    drafter.config = dataclasses.replace(drafter.config, aux_layer_ids=(0, 1, 8))
    with pytest.raises(ValueError, match=r"aux_layer_ids.*8-layer target"):
        SpeculativeDecoder(target, drafter, k=3)


def test_vllm_head_without_aux_ids_reads_the_target_default(models, tmp_path):
    """A vLLM folder whose config names no aux layers loads with aux_layer_ids None and then
    decodes with the paired target's default ids, as vLLM does (it used to fail with
    `TypeError: 'NoneType' object is not iterable`)."""
    import json

    from peagle_jax.formats import export_vllm

    _, target = models["llama-gqa2-tied-llama3"]
    folder = export_vllm(pj.new_drafter(target, mode="parallel", seed=6), tmp_path / "head", dtype="float32")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("eagle_aux_hidden_state_layer_ids")
    cfg["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")
    (folder / "config.json").write_text(json.dumps(cfg))
    head = pj.load_drafter(folder)
    assert head.config.aux_layer_ids is None
    prompts = _prompts(2, seed=12)
    plain = SpeculativeDecoder(target, mode="none").generate(prompts, max_new_tokens=8)
    res = SpeculativeDecoder(target, head, k=3).generate(prompts, max_new_tokens=8)
    assert res.tokens == plain.tokens
    assert res.stats["aux_layer_ids_from"] == "target default"
    assert tuple(res.stats["aux_layer_ids"]) == target.config.default_aux_layer_ids()
