"""`python -m infer bench`: baseline (mode none) vs speculative decoding on the same prompts.

Both decoders share one target and one compiled shape (prompts padded to the longest, one
cache length), run interleaved prompt by prompt so machine noise hits both alike, and
compile time is excluded by a warm-up pass.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm import tqdm

from peagle_jax import cache as kv
from peagle_jax import speculative as sp
from peagle_jax.folders import atomic_write_text
from peagle_jax.generation import SpeculativeDecoder, encode_prompt
from peagle_jax.prompts import load_prompts


@functools.partial(jax.jit, static_argnums=(0, 1))
def _draft_only(cfg, ddef, dstate, tokens, aux, positions, bonus_slot, cache):
    return sp.draft(cfg, nnx.merge(ddef, dstate), tokens, aux, positions, bonus_slot, cache)[0]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _verify_only(cfg, tdef, tstate, tokens, positions, cache):
    out = nnx.merge(tdef, tstate)(tokens, positions, cache, aux_layer_ids=cfg.aux_layer_ids)
    return out.logits, out.aux_hidden


def _median_ms(fn, reps: int) -> float:
    jax.block_until_ready(fn())  # compile / warm
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def round_ms(dec: SpeculativeDecoder, prompt, reps: int = 5) -> float:
    """Median wall time of one whole round (verify + accept + draft) after `prompt`."""
    cfg, _, state = dec.start([prompt], max_new_tokens=(reps + 2) * (dec.k + 1) + 8)
    mods = dec.modules()
    state = sp.jit_round(cfg, *mods, state)  # compile
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        state = jax.block_until_ready(sp.jit_round(cfg, *mods, state))
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def round_breakdown(dec: SpeculativeDecoder, prompt, reps: int = 5) -> dict:
    """Milliseconds per round of the drafter alone (half the drafts accepted) and of the
    target's verification of K+1 tokens alone, timed on the state after `prompt`."""
    cfg, _, state = dec.start([prompt], max_new_tokens=8)
    tdef, tstate, ddef, dstate = dec.modules()
    k, b = dec.k, state.last.shape[0]
    slots = jnp.arange(k + 1)[None, :]
    positions = state.length[:, None] + slots
    tokens = jnp.concatenate([state.last[:, None], state.drafts], axis=1)
    result = {
        "target_ms_per_round": _median_ms(
            lambda: _verify_only(cfg, tdef, tstate, tokens, positions, state.target_cache), reps
        )
    }
    if dec.mode != "none":
        aux = jnp.zeros((b, k + 1, 3 * dec.target.config.hidden_size), state.target_cache[0][0].dtype)
        n = jnp.full((b,), k // 2, jnp.int32)
        draft_pos = jnp.where(slots <= n[:, None], positions, -1)
        result["drafter_ms_per_round"] = _median_ms(
            lambda: _draft_only(cfg, ddef, dstate, tokens, aux, draft_pos, n, state.drafter_cache), reps
        )
    return result


def _batches(items, size):
    return [items[i : i + size] for i in range(0, len(items), size)]


def run_bench(args, target, drafter, make, stop_token_ids=None) -> dict:
    conversations = load_prompts(args.prompts, limit=args.limit)
    if not conversations:
        raise ValueError(f"--prompts {args.prompts}: no prompts")
    ids = [encode_prompt(target.tokenizer, c) for c in conversations]
    longest = max(len(i) for i in ids)
    # one shape for both decoders and every batch: prompts padded to the longest, one cache length
    pad = kv.round_up(longest, kv.LENGTH_MULTIPLE)
    shape = dict(prompt_pad=pad, cache_len=kv.bucket_length(pad, args.max_new_tokens, args.k))
    base, spec = make("none", **shape), make(args.mode, **shape)
    kw = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop_token_ids=stop_token_ids,
    )
    batches = _batches(ids, args.batch_size)
    for name, dec in (("plain", base), (args.mode, spec)):  # warm-up: compile outside the timings
        t0 = time.perf_counter()
        dec.generate(batches[0], **kw)
        print(
            f"[infer] warm-up ({name}, compilation included): {time.perf_counter() - t0:.1f}s",
            file=sys.stderr,
            flush=True,
        )
    rows = []
    for batch in tqdm(batches, desc=f"bench {args.mode} k={args.k}", file=sys.stderr):
        b = base.generate(batch, **kw)
        s = spec.generate(batch, **kw)
        rows.append(
            {"base": b.stats, "spec": s.stats, "same_tokens": b.tokens == s.tokens if args.temperature == 0 else None}
        )
    result = summarize(args, rows)
    result.update(round_breakdown(spec, batches[0][0]))
    _print(result)
    if args.json_out:
        _write_json(args.json_out, {**result, "per_batch": rows})
    return result


def summarize(args, rows) -> dict:
    def total(key, side):
        return sum(r[side][key] for r in rows)

    base_tps = total("new_tokens", "base") / total("seconds", "base")
    spec_tps = total("new_tokens", "spec") / total("seconds", "spec")
    rounds = total("rounds", "spec")
    acc = sum(r["spec"]["acceptance_length"] * r["spec"]["rounds"] for r in rows) / max(rounds, 1)
    per_pos = [
        sum(r["spec"]["per_position_acceptance"][i] * r["spec"]["rounds"] for r in rows) / max(rounds, 1)
        for i in range(args.k if args.mode != "none" else 0)
    ]
    return {
        "prompts": args.prompts,
        "mode": args.mode,
        "k": args.k,
        "batches": len(rows),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "baseline_tokens_per_second": base_tps,
        "speculative_tokens_per_second": spec_tps,
        "speedup": spec_tps / base_tps,
        "acceptance_length": acc,
        "per_position_acceptance": per_pos,
        "ms_per_round": 1000 * total("seconds", "spec") / max(rounds / args.batch_size, 1),
        "identical_greedy_outputs": all(r["same_tokens"] for r in rows) if args.temperature == 0 else None,
        "median_batch_speedup": statistics.median(
            (r["spec"]["tokens_per_second"] / r["base"]["tokens_per_second"]) for r in rows
        ),
    }


def _print(r: dict) -> None:
    print(f"{'prompts':<28}{r['prompts']}")
    print(f"{'mode / k':<28}{r['mode']} / {r['k']}")
    print(f"{'baseline tokens/s':<28}{r['baseline_tokens_per_second']:.2f}")
    print(f"{'speculative tokens/s':<28}{r['speculative_tokens_per_second']:.2f}")
    print(f"{'speedup':<28}{r['speedup']:.2f}x")
    print(f"{'acceptance length':<28}{r['acceptance_length']:.3f}")
    print(f"{'per-position acceptance':<28}" + " ".join(f"{a:.2f}" for a in r["per_position_acceptance"]))
    print(f"{'ms per round':<28}{r['ms_per_round']:.1f}")
    print(f"{'drafter / target ms':<28}{r.get('drafter_ms_per_round', 0):.1f} / {r['target_ms_per_round']:.1f}")
    if r["identical_greedy_outputs"] is not None:
        print(f"{'identical greedy outputs':<28}{r['identical_greedy_outputs']}")


def _write_json(path: str, data: dict) -> None:
    atomic_write_text(path, json.dumps(data, indent=1))
