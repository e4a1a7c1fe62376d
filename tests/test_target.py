"""Target models against Hugging Face transformers (torch CPU, float32) on tiny random configs.

Logits within 1e-4, every aux hidden state equal to its `output_hidden_states` entry
(vLLM convention: aux id i = the residual stream entering layer i = hidden_states[i]),
cached prefill + decode + multi-token extension equal to one full forward, ragged batches
equal to per-row runs, greedy generation equal to transformers' `generate`.
"""

from __future__ import annotations

import json

import hf_tiny
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paths import VECTORS

import peagle_jax as pj
from peagle_jax.engine import generate_greedy
from peagle_jax.models.registry import target_config

torch = pytest.importorskip("torch")

GOLDEN = VECTORS
L = hf_tiny.LAYERS
AUX = (0, 1, 2)  # every layer of the 3-layer tiny models


def _close(got, want, tol, what):
    """max |got - want| <= tol * max(1, max |want|): f32 round-off grows with the activations'
    scale (the residual stream reaches ~10 here), so the bound is relative to it above 1."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    bound = tol * max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max())
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("kind", list(hf_tiny.SPECS))
def test_matches_transformers(kind, built):
    folder, hf = built(kind)
    target = pj.load_target(folder, dtype="float32", aux_layer_ids=AUX)
    ids = hf_tiny.tokens(2, 12, seed=1)  # 12 > the gemma3 sliding window (5)
    logits, hidden_states = hf_tiny.hf_run(hf, ids)

    out = target.forward(ids)
    assert out.logits.dtype == jnp.float32
    assert out.logits.shape == (2, 12, hf_tiny.VOCAB)
    assert out.aux_hidden.shape == (2, 12, 3 * hf_tiny.HIDDEN)
    assert out.cache is None
    np.testing.assert_allclose(np.asarray(out.logits), logits, rtol=0, atol=1e-4)
    aux = np.asarray(out.aux_hidden).reshape(2, 12, 3, -1)
    for j, layer in enumerate(AUX):
        _close(aux[:, :, j], hidden_states[layer], 1e-5, f"aux id {layer}")
    _close(out.hidden, hidden_states[-1], 1e-5, "final-norm hidden")


@pytest.mark.parametrize("kind", ["llama-mha-untied", "gemma3", "gpt_oss"])
def test_a_long_sequence_attends_blockwise_and_matches_transformers(kind, built):
    """Past kernels.DENSE_MAX_ROWS tokens a forward without a cache (training features) runs the
    blockwise kernels, with no [T, T] scores in the program, and the same numbers (window,
    softcap and sinks included)."""
    from flax import nnx

    folder, hf = built(kind)
    target = pj.load_target(folder, dtype="float32", aux_layer_ids=AUX)
    t = 640
    ids = hf_tiny.tokens(1, t, seed=3)
    logits, hidden_states = hf_tiny.hf_run(hf, ids)
    out = target.forward(ids)
    _close(out.logits, logits, 1e-4, "logits")
    _close(out.aux_hidden[..., -hf_tiny.HIDDEN :], hidden_states[AUX[-1]], 1e-5, "aux")
    model = nnx.merge(target.graphdef, target.state)
    positions = jnp.arange(t)[None]
    text = jax.jit(lambda x: model(x, positions).logits).lower(jnp.asarray(ids)).as_text()
    assert f"{t}x{t}x" not in text  # no [.., T, T] buffer: the scores of a dense mask


def test_old_rope_keys_parse_the_same(built, tmp_path):
    """transformers v4 `rope_theta` + `rope_scaling` (with `type` or `rope_type`) = v5 `rope_parameters`."""
    folder, _ = built("llama-gqa2-tied-llama3")
    v5 = json.loads((folder / "config.json").read_text())
    for type_key in ("rope_type", "type"):
        v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
        params = dict(v5["rope_parameters"])
        v4["rope_theta"] = params.pop("rope_theta")
        params[type_key] = params.pop("rope_type")
        v4["rope_scaling"] = params
        assert target_config(v4) == target_config(v5)
    cfg = target_config(v5)
    assert cfg.rope.type == "llama3"
    assert cfg.rope.factor == 8.0
    assert cfg.tie_word_embeddings


@pytest.mark.parametrize("kind", ["llama-gqa2-tied-llama3", "gemma3"])
def test_cached_decode_equals_full_forward(kind, built):
    """Prefill 7, two 1-token steps, a 4-token extension (verification of K+1), one more step."""
    folder, _ = built(kind)
    target = pj.load_target(folder, dtype="float32", aux_layer_ids=AUX)
    ids = hf_tiny.tokens(2, 14, seed=2)
    full = target.forward(ids)
    cache = target.init_cache(2, 24)
    assert cache[0][0].shape == (2, 24, target.config.num_kv_heads, target.config.head_dim)
    start = 0
    for n in (7, 1, 1, 4, 1):
        pos = np.broadcast_to(np.arange(start, start + n), (2, n))
        out = target.apply(ids[:, start : start + n], pos, cache)
        cache = out.cache
        sl = slice(start, start + n)
        np.testing.assert_allclose(np.asarray(out.logits), np.asarray(full.logits[:, sl]), rtol=1e-5, atol=1e-5)
        _close(out.aux_hidden, np.asarray(full.aux_hidden[:, sl]), 1e-5, f"aux at {start}")
        _close(out.hidden, np.asarray(full.hidden[:, sl]), 1e-5, f"hidden at {start}")
        start += n


def test_ragged_batch_equals_per_row(built):
    """Right padding with position -1: each valid row equals its own (unpadded) run."""
    folder, hf = built("gemma3")
    target = pj.load_target(folder, dtype="float32", aux_layer_ids=AUX)
    lengths = [5, 12, 9]
    ids = hf_tiny.tokens(3, 12, seed=3)
    pos = np.where(np.arange(12)[None] < np.array(lengths)[:, None], np.arange(12)[None], -1)
    no_cache = target.apply(ids, pos)
    cached = target.apply(ids, pos, target.init_cache(3, 16), logits_at=np.array(lengths)[:, None] - 1)
    for b, n in enumerate(lengths):
        logits, hs = hf_tiny.hf_run(hf, ids[b : b + 1, :n])
        np.testing.assert_allclose(np.asarray(no_cache.logits[b, :n]), logits[0], atol=1e-4, rtol=0)
        aux = np.asarray(no_cache.aux_hidden[b, :n]).reshape(n, 3, -1)
        for j, layer in enumerate(AUX):
            _close(aux[:, j], hs[layer][0], 1e-5, f"row {b} aux {layer}")
        _close(cached.hidden[b, :n], hs[-1][0], 1e-5, f"cached row {b}")
        np.testing.assert_allclose(np.asarray(cached.logits[b, 0]), logits[0, -1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["llama-mha-untied", "gemma3"])
def test_generate_greedy_matches_transformers(kind, built):
    folder, hf = built(kind)
    target = pj.load_target(folder, dtype="float32", aux_layer_ids=AUX)
    prompts = [list(hf_tiny.tokens(1, n, seed=10 + n)[0]) for n in (3, 11, 7)]
    new = 8
    want = []
    for p in prompts:
        with torch.no_grad():
            seq = hf.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
        want.append(seq[0, len(p) :].tolist())
    assert generate_greedy(target, prompts, new, eos=()) == want  # one ragged batch = per-row HF runs

    # per-row EOS: a row stops at (and keeps) its first EOS token, the others go on
    eos = want[0][2]
    got = generate_greedy(target, prompts, new, eos=eos)
    for g, w in zip(got, want):
        assert g == (w[: w.index(eos) + 1] if eos in w else w)


def test_golden_tiny_target():
    """The shared golden vectors (peagle-tiny): default aux ids (2, 4, 5) for 8 layers."""
    if not GOLDEN.exists():
        pytest.skip("no golden vectors")
    data = np.load(GOLDEN / "propose.npz")
    target = pj.load_target(GOLDEN / "target", dtype="float32")
    assert target.aux_layer_ids == (2, 4, 5)
    assert target.tokenizer is None
    out = target.forward(data["prompt"][None].astype(np.int32))
    _close(out.aux_hidden[0], data["aux_hidden"], 1e-5, "golden aux_hidden")
    assert int(jnp.argmax(out.logits[0, -1])) == int(data["bonus"])


def test_bf16_load(built):
    folder, hf = built("gemma3")
    target = pj.load_target(folder, dtype="bfloat16", aux_layer_ids=AUX)
    assert {x.dtype for x in jax.tree.leaves(target.state)} == {jnp.dtype(jnp.bfloat16)}
    ids = hf_tiny.tokens(2, 12, seed=1)
    logits, _ = hf_tiny.hf_run(hf, ids)
    out = target.forward(ids)
    assert out.logits.dtype == jnp.float32
    assert out.aux_hidden.dtype == jnp.bfloat16
    err = np.abs(np.asarray(out.logits) - logits)
    assert err.max() < 0.25, (err.max(), err.mean())
    assert err.mean() < 0.05, (err.max(), err.mean())
    cache = target.init_cache(2, 16)
    assert cache[0][0].dtype == jnp.bfloat16
    step = target.apply(ids[:, :4], np.broadcast_to(np.arange(4), (2, 4)), cache)
    assert step.cache[0][0].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(step.logits), np.asarray(out.logits[:, :4]), atol=0.1)


@pytest.mark.parametrize("ids", [(0, 1), (0, 0, 1), (0, 1, L), (-1, 0, 1), (0, 1, 2.0), (True, 0, 1), "abc", 3])
def test_bad_aux_layer_ids(ids, built):
    folder, _ = built("llama-mha-untied")
    with pytest.raises(ValueError, match="aux_layer_ids"):
        pj.load_target(folder, dtype="float32", aux_layer_ids=ids)


def test_default_aux_ids(built, tmp_path):
    folder, _ = built("llama-mha-untied")
    assert pj.load_target(folder, dtype="float32").aux_layer_ids == (0, 1, 2)  # (2, L//2, L-3) in layer order
    small = tmp_path / "two-layers"
    small.mkdir()
    (small / "config.json").write_text((folder / "config.json").read_text())
    hf_tiny.edit_config(small, lambda c: c.update(num_hidden_layers=2))
    with pytest.raises(ValueError, match=r"aux_layer_ids.*2-layer"):  # before any weight is read
        pj.load_target(small, dtype="float32")


def test_bad_input_ids(built):
    folder, _ = built("llama-mha-untied")
    target = pj.load_target(folder, dtype="float32", aux_layer_ids=AUX)
    with pytest.raises(ValueError, match="input_ids"):
        target.forward([1, 2, 3])
    with pytest.raises(ValueError, match="input_ids"):
        target.forward([[1, hf_tiny.VOCAB]])
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate_greedy(target, [[1], []], 2)
    with pytest.raises(ValueError, match="position 8 does not fit a KV cache of 8 slots"):
        target.apply([[1, 2]], [[7, 8]], target.init_cache(1, 8))
    with pytest.raises(ValueError, match="does not fit the KV cache of 10 positions"):
        generate_greedy(target, [[1, 2, 3]], 6, cache_len=10)  # needs 3 + 6 + 2 = 11 slots
