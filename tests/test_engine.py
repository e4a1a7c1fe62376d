"""The Engine's per-request settings are data: one compile serves every temperature, top-p and
stop set; log-probabilities are the target's log-softmax; penalties, logit_bias, top_k / min_p,
min_tokens and ignore_eos are exactly what plain decoding under them gives, on real shapes (a tiny
Llama and a random P-EAGLE head)."""

from __future__ import annotations

import hf_tiny
import jax
import numpy as np
import pytest
from sampling_law import chi2_pvalue, sample_counts
from test_speculative import _skip_ahead_drafter, _successor_target

import peagle_jax as pj
from infer import SpeculativeDecoder
from peagle_jax.engine import speculative as sp

K, NEW = 3, 12
CACHE = 192  # a cache length no other test of the module uses: its programs compile here


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("engine") / "target"
    hf_tiny.build("llama-gqa2-tied-llama3", folder)
    return pj.load_target(folder, dtype="float32")


@pytest.fixture(scope="module")
def decoder(target):
    return SpeculativeDecoder(target, pj.new_drafter(target, num_layers=1, mode="parallel", seed=1), k=K)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, hf_tiny.VOCAB, size=int(m)).tolist() for m in rng.integers(3, 20, size=n)]


def test_temperatures_top_p_and_stop_sets_compile_the_engine_once(target):
    dec = SpeculativeDecoder(
        target, pj.new_drafter(target, num_layers=1, mode="parallel", seed=2), k=K, cache_len=CACHE
    )
    before = sp.jit_generate._cache_size(), sp.jit_prefill._cache_size()
    outputs = {}
    for temperature, top_p in ((0.0, 1.0), (0.7, 0.9), (1.0, 1.0)):
        for stops in (None, [5], [7, 9, 11]):
            res = dec.generate(prompts(2), NEW, temperature=temperature, top_p=top_p, seed=3, stop_token_ids=stops)
            outputs[temperature, stops and tuple(stops)] = res.tokens
    after = sp.jit_generate._cache_size(), sp.jit_prefill._cache_size()
    assert (after[0] - before[0], after[1] - before[1]) == (1, 1)
    assert outputs[0.7, None] != outputs[0.0, None]  # the settings were used
    greedy = outputs[0.0, None]
    for stops in ((5,), (7, 9, 11)):  # a stop set cuts the greedy output at its first stop id
        for row, got in zip(greedy, outputs[0.0, stops]):
            cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            assert got == row[:cut]


def test_logprobs_are_the_targets_log_softmax_at_each_token(decoder, target):
    ps = prompts(3, seed=1)
    res = decoder.generate(ps, NEW, logprobs=4)
    plain = decoder.generate(ps, NEW)
    assert res.tokens == plain.tokens  # recording changes nothing else
    for prompt, tokens, got in zip(ps, res.tokens, res.logprobs):
        logits = np.asarray(target.forward(np.asarray([prompt + tokens])).logits[0], np.float64)
        lsm = (
            logits
            - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
            - logits.max(-1, keepdims=True)
        )
        at = lsm[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]  # the rows that chose each token
        assert len(got) == len(tokens)
        np.testing.assert_allclose([lp for lp, _ in got], at[np.arange(len(tokens)), tokens], atol=1e-4)
        for row, (_, top) in zip(at, got):
            assert [t for t, _ in top] == np.argsort(-row)[:4].tolist()
            np.testing.assert_allclose([v for _, v in top], np.sort(row)[::-1][:4], atol=1e-4)


def plain_penalized(target, prompt, n, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """Greedy decoding under vLLM's penalties, one full forward a token (no cache, no engine)."""
    out = []
    for _ in range(n):
        logits = np.asarray(target.forward(np.asarray([prompt + out])).logits[0, -1], np.float64)
        for t, b in (bias or {}).items():
            logits[t] += b
        counts = np.bincount(out, minlength=len(logits))
        seen = (np.bincount(prompt, minlength=len(logits)) > 0) | (counts > 0)
        logits = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
        logits = logits - frequency * counts - presence * (counts > 0)
        out.append(int(np.argmax(logits)))
    return out


@pytest.mark.parametrize(
    "kw",
    [
        dict(presence_penalty=1.5),
        dict(frequency_penalty=0.8, repetition_penalty=1.6),
        dict(repetition_penalty=0.5, logit_bias={7: 3.0, 9: -2.0}),
    ],
)
def test_greedy_under_penalties_and_bias_equals_plain_decoding_under_them(decoder, target, kw):
    ps = prompts(2, seed=3)
    got = decoder.generate(ps, NEW, **kw)
    names = dict(presence_penalty="presence", frequency_penalty="frequency", repetition_penalty="repetition")
    ref_kw = {names[k]: v for k, v in kw.items() if k in names} | {"bias": kw.get("logit_bias")}
    eos = set(decoder.eos_ids)
    for prompt, tokens in zip(ps, got.tokens):
        want = plain_penalized(target, prompt, NEW, **ref_kw)
        cut = next((i + 1 for i, t in enumerate(want) if t in eos), NEW)
        assert tokens == want[:cut]
    assert got.tokens != decoder.generate(ps, NEW).tokens  # the penalties changed something


def test_top_k_1_and_min_p_1_sample_the_greedy_token(decoder):
    ps = prompts(2, seed=4)
    greedy = decoder.generate(ps, NEW).tokens
    assert decoder.generate(ps, NEW, temperature=1.5, top_k=1, seed=5).tokens == greedy
    assert decoder.generate(ps, NEW, temperature=1.5, min_p=1.0, seed=6).tokens == greedy
    assert decoder.generate(ps, NEW, temperature=1.5, top_k=3, seed=6).tokens != greedy


def test_min_tokens_and_ignore_eos(target, decoder):
    prompt = prompts(1, seed=5)[0]
    first = decoder.generate([prompt], NEW).tokens[0]
    j = next(i for i in range(1, NEW) if first[i] not in first[:i])  # a token that first comes at j
    dec = SpeculativeDecoder(target, decoder.drafter, k=K, eos_ids=[first[j]])
    assert dec.generate([prompt], NEW).tokens[0] == first[: j + 1]
    held = dec.generate([prompt], NEW, min_tokens=j + 3).tokens[0]
    assert len(held) >= j + 3 and first[j] not in held[: j + 3]
    assert held[:j] == first[:j]  # the mask changes nothing before its first stop id
    assert dec.generate([prompt], NEW, ignore_eos=True).tokens[0] == first


def test_penalties_count_the_drafts_before_each_slot():
    """`sampler.penalize` at slot j equals vLLM's formula with the drafts d1..dj counted as generated."""
    from peagle_jax.engine import sampler
    from peagle_jax.engine.sampling import SamplingParams

    rng = np.random.default_rng(0)
    b, j, v = 3, 5, 11
    logits = rng.normal(size=(b, j, v)).astype(np.float32) * 3
    counts = rng.integers(0, 3, size=(b, v)).astype(np.int32)
    seen = rng.random((b, v)) < 0.3
    drafts = rng.integers(0, 4, size=(b, j - 1)).astype(np.int32)  # few ids: repeats among the drafts
    params = [SamplingParams(4, 1.0, presence_penalty=p, frequency_penalty=f, repetition_penalty=r)
              for p, f, r in ((0.5, 0.25, 1.5), (0.0, 1.0, 0.7), (1.0, 0.0, 1.0))]  # fmt: skip
    s = decoder_sampling(params)
    got = np.asarray(sampler.penalize(logits, s, drafts, counts, seen))
    for row, p in enumerate(params):
        for slot in range(j):
            c = counts[row] + np.bincount(drafts[row, :slot], minlength=v)
            x = logits[row, slot].astype(np.float64)
            present = seen[row] | (c > 0)
            x = np.where(present, np.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
            want = x - p.frequency_penalty * c - p.presence_penalty * (c > 0)
            np.testing.assert_allclose(got[row, slot], want, rtol=1e-6, atol=1e-6)


def decoder_sampling(params):
    from peagle_jax.engine.sampling import row_key, sampling_rows

    return sampling_rows(params, (), len(params), [row_key(0, i) for i in range(len(params))])


def test_lossless_sampling_under_penalties(tmp_path):
    """Speculative sampling under penalties draws from the law of plain sampling under them (the
    likeliest next tokens, x + 1, are in the prompt: the penalties move the law)."""
    _, succ = _successor_target(tmp_path, 0.6)
    prompt = [8, 9, 10, 7]
    plain = SpeculativeDecoder(succ, mode="none")
    spec = SpeculativeDecoder(succ, _skip_ahead_drafter(succ, "parallel"), k=2, mode="parallel")
    kw = dict(repetition_penalty=3.0, presence_penalty=0.5, frequency_penalty=0.3)
    base = counts(plain, prompt, kw, range(2))
    good = counts(spec, prompt, kw, [s + 100 for s in range(2)])
    assert chi2_pvalue(base, good) > 1e-3
    unpenalized = sample_counts(spec, prompt, 512, range(200, 202), 3)
    assert chi2_pvalue(base, unpenalized) < 1e-6  # the penalties do move the law


def counts(dec, prompt, kw, seeds):
    out = {}
    for seed in seeds:
        for row in dec.generate([prompt] * 512, 3, temperature=1.0, top_p=0.9, seed=seed, **kw).tokens:
            out[tuple(row)] = out.get(tuple(row), 0) + 1
    return out


def test_unknown_and_bad_settings_are_refused(decoder):
    with pytest.raises(TypeError, match="unknown sampling settings"):
        decoder.generate([[1, 2]], 4, top_q=0.5)
    with pytest.raises(ValueError, match="top_k"):
        decoder.generate([[1, 2]], 4, top_k=-1)
    with pytest.raises(ValueError, match="logit_bias: token id 999"):
        decoder.generate([[1, 2]], 4, logit_bias={999: 1.0})
    jax.clear_caches()  # nothing above compiled: refusals come first


def test_a_head_of_the_same_network_swaps_in_without_a_compile(target, decoder):
    """`Engine.with_drafter`: another head of the served network (other weights, other training
    records) runs the compiled programs as they are; a head of another shape is refused by name."""
    import dataclasses

    ps = prompts(2, seed=7)
    before = decoder.generate(ps, NEW).tokens  # compiles the programs of this shape
    sizes = sp.jit_generate._cache_size(), sp.jit_prefill._cache_size()
    other = pj.new_drafter(target, num_layers=1, mode="parallel", seed=9)
    other.config = dataclasses.replace(other.config, k_train=5)  # a record, not the network
    swapped = SpeculativeDecoder(target, decoder.drafter, k=K)
    swapped.engine = decoder.engine.with_drafter(other)
    assert swapped.generate(ps, NEW).tokens == before  # greedy: the target's, whoever drafts
    assert (sp.jit_generate._cache_size(), sp.jit_prefill._cache_size()) == sizes
    drafts = swapped.propose(ps[0])  # the new head's drafts, not the old one's
    assert drafts == SpeculativeDecoder(target, other, k=K).propose(ps[0]) != decoder.propose(ps[0])
    assert other.fingerprint() != decoder.drafter.fingerprint()
    with pytest.raises(ValueError, match="num_layers 1 -> 2"):
        decoder.engine.with_drafter(pj.new_drafter(target, num_layers=2, mode="parallel", seed=9))
