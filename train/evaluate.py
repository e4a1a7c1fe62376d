"""End-of-run evaluation: acceptance length and speedup of the trained head against plain
greedy decoding on held-out prompts (the speculative engine of `peagle_jax.generation`).

Each prompt is decoded alone (batch 1, the regime speculative decoding targets), in the
trainer's own prompt format (`peagle_jax.chat.encode_prompt`); every prompt is padded to one
length and one KV cache size, so each decoder compiles once, and that compile is done on the
first prompt before timing. Acceptance length = 1 + accepted drafts per round (vLLM's
definition), averaged over all rounds of all prompts. The outputs of speculative decoding
are checked equal to plain greedy decoding (greedy speculative decoding is lossless).
"""

from __future__ import annotations

import numpy as np

from peagle_jax.generation import SpeculativeDecoder

__all__ = ["measure"]


def _run(dec: SpeculativeDecoder, prompts, max_new: int):
    dec.generate([prompts[0]], max_new_tokens=max_new)  # compile
    tokens, seconds, new, rounds, acc_sum = [], 0.0, 0, 0, 0.0
    for p in prompts:
        res = dec.generate([p], max_new_tokens=max_new)
        tokens.append(res.tokens[0])
        seconds += res.stats["seconds"]
        new += res.stats["new_tokens"]
        r = int(res.stats.get("rounds", 0))
        rounds += r
        acc_sum += res.stats.get("acceptance_length", 0.0) * r
    return tokens, seconds, new, (acc_sum / rounds if rounds else 0.0)


def measure(target, drafter, prompts: list[list[int]], *, ks, mode: str, max_new: int) -> dict:
    """{"baseline_tokens_per_second", "prompts", "max_new_tokens", "by_k": {k: {...}}}."""
    if not prompts:
        raise ValueError("evaluation: no prompt fits (all longer than the limit)")
    pad = int(np.ceil(max(len(p) for p in prompts) / 64.0)) * 64
    cache = int(np.ceil((pad + max_new + 2 * max(ks) + 8) / 64.0)) * 64
    base = SpeculativeDecoder(target, mode="none", cache_len=cache, prompt_pad=pad)
    ref, b_sec, b_new, _ = _run(base, prompts, max_new)
    out = {"prompts": len(prompts), "max_new_tokens": max_new, "baseline_tokens_per_second": b_new / b_sec, "by_k": {}}
    for k in ks:
        dec = SpeculativeDecoder(target, drafter, k=k, mode=mode, cache_len=cache, prompt_pad=pad, deep_k="warn")
        toks, sec, new, acc = _run(dec, prompts, max_new)
        same = sum(a == b for a, b in zip(toks, ref)) / len(ref)
        out["by_k"][int(k)] = {
            "k": int(k),
            "acceptance_length": acc,
            "tokens_per_second": new / sec,
            "speedup": (new / sec) / (b_new / b_sec),
            "identical_to_greedy": same,
        }
    return out
