"""`python -m infer bench`: plain decoding vs one or more drafter heads at one or more K.

Every decoder (plain, and each head at each K) shares one target and one compiled shape
(prompts padded to the longest, one cache length sized for the largest K), and they run
interleaved batch by batch (plain first, then every head and K on the same prompts), so
machine noise hits all of them alike and the ratios are measured side by side. Compile time
is excluded by a warm-up pass. Greedy outputs of every head are checked equal to plain
decoding's, prompt by prompt (mismatches counted).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from infer.load import synthetic_lengths
from peagle_jax.engine import SpeculativeDecoder, load_prompts, prompt_ids
from peagle_jax.engine import cache as kv
from peagle_jax.engine import speculative as sp
from peagle_jax.folders import atomic_write_text


@dataclasses.dataclass
class Head:
    """A drafter under test: its label in tables, the loaded drafter, and its mode."""

    label: str
    drafter: object
    mode: str


@functools.partial(jax.jit, static_argnums=(0, 1))
def _draft_only(cfg, ddef, dstate, tokens, aux, positions, bonus_slot, cache):
    return sp.draft(cfg, nnx.merge(ddef, dstate), tokens, aux, positions, bonus_slot, cache)[0]


@functools.partial(jax.jit, static_argnums=(0, 1))
def _verify_only(aux_layer_ids, tdef, tstate, tokens, positions, cache):
    out = nnx.merge(tdef, tstate)(tokens, positions, cache, aux_layer_ids=aux_layer_ids)
    return out.logits, out.aux_hidden


@dataclasses.dataclass(frozen=True)
class Timing:
    """A program's first call less one warm call (its compilation, about) and its median ms."""

    compile_s: float
    ms: float


def timed(fn, reps: int) -> Timing:
    """Times `fn` (returning device arrays): its first call, then the median of `reps` calls."""
    t = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    median = statistics.median(times)
    return Timing(max(first - median, 0.0), 1000 * median)


def _as_batch(prompts) -> list:
    """One prompt (ids or text) or a batch of them -> a batch."""
    return prompts if prompts and isinstance(prompts[0], (list, tuple)) else [prompts]


def round_timing(dec: SpeculativeDecoder, prompts, reps: int = 5) -> Timing:
    """One whole round (verify + accept + draft) after `prompts` (one prompt or a batch);
    in mode "none", one plain decode step."""
    cfg, _, state = dec.start(_as_batch(prompts), max_new_tokens=(reps + 2) * (dec.k + 1) + 8)
    mods = dec.modules()
    box = [state]

    def step():
        box[0] = sp.jit_round(cfg, *mods, box[0])  # the state is donated: each call takes the last one
        return box[0]

    return timed(step, reps)


def round_ms(dec: SpeculativeDecoder, prompts, reps: int = 5) -> float:
    """Median wall time of one whole round after `prompts` (`round_timing`)."""
    return round_timing(dec, prompts, reps).ms


def round_breakdown(dec: SpeculativeDecoder, prompts, reps: int = 5) -> dict:
    """Milliseconds per round of the drafter alone (half the drafts accepted) and of the
    target's verification of K+1 tokens alone, and each program's compile seconds, timed on
    the state after `prompts` (one prompt, or a batch of them)."""
    cfg, _, state = dec.start(_as_batch(prompts), max_new_tokens=8)
    tdef, tstate, ddef, dstate = dec.modules()
    k, b = dec.k, state.last.shape[0]
    slots = jnp.arange(k + 1)[None, :]
    positions = state.length[:, None] + slots
    tokens = jnp.concatenate([state.last[:, None], state.drafts], axis=1)
    verify = timed(lambda: _verify_only(cfg.aux_layer_ids, tdef, tstate, tokens, positions, state.target_cache), reps)
    result = {"target_ms_per_round": verify.ms, "target_compile_s": verify.compile_s}
    if dec.mode != "none":
        aux = jnp.zeros((b, k + 1, dec.drafter.config.fc_in), state.target_cache[0][0].dtype)  # the aux states it reads
        n = jnp.full((b,), k // 2, jnp.int32)
        draft_pos = jnp.where(slots <= n[:, None], positions, -1)
        draft = timed(lambda: _draft_only(cfg, ddef, dstate, tokens, aux, draft_pos, n, state.drafter_cache), reps)
        result.update(drafter_ms_per_round=draft.ms, drafter_compile_s=draft.compile_s)
    return result


def _batches(items, size):
    return [items[i : i + size] for i in range(0, len(items), size)]


SYNTHETIC_COUNT = 8  # prompts of --prompts synthetic:LENGTHS without --limit


def synthetic_prompts(batch: int, length: int, vocab: int, avoid=(), seed: int = 0) -> list[list[int]]:
    """`batch` prompts of `length` random token ids in [0, vocab), none of them in `avoid` (eos)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(batch, length))
    for token in avoid:
        ids[ids == token] = (token + 1) % vocab
    return ids.tolist()


def source_prompt_ids(target, source: str, limit: int | None = None, max_tokens: int | None = None) -> list[list[int]]:
    """Token ids of the prompts of `source` (mtbench | humaneval | a JSONL file) in the target's
    format, or of `synthetic:LENGTHS` (random ids, `limit` or 8 prompts cycling through the
    lengths); with `max_tokens`, longer prompts are left out; at most `limit` of them."""
    lengths = synthetic_lengths(source)
    if lengths is not None:
        c = target.config
        rows = [synthetic_prompts(1, lengths[i % len(lengths)], c.vocab_size, c.eos_token_id, seed=i)[0]
                for i in range(limit or SYNTHETIC_COUNT)]  # fmt: skip
        ids = [r for r in rows if max_tokens is None or len(r) <= max_tokens]
    elif target.tokenizer is None:
        where = getattr(target, "path", None) or "the target"
        raise ValueError(
            f"--prompts {source}: text prompts need a tokenizer, and {where} has none (tokenizer.json); "
            "--prompts synthetic:LENGTHS needs none"
        )
    else:
        ids = prompt_ids(target.tokenizer, load_prompts(source), max_tokens, limit)
    if not ids:
        raise ValueError(f"--prompts {source}: no prompts" + (f" of at most {max_tokens} tokens" if max_tokens else ""))
    return ids


def shape_for(prompts: list[list[int]], max_new_tokens: int, k_max: int) -> dict:
    """One compiled shape for every decoder: prompts padded to the longest, one cache length."""
    pad = kv.round_up(max(len(p) for p in prompts), kv.LENGTH_MULTIPLE)
    return dict(prompt_pad=pad, cache_len=kv.bucket_length(pad, max_new_tokens, k_max))


def compare(
    target,
    heads: list[Head],
    ks: list[int],
    prompts: list[list[int]],
    *,
    batch_size: int = 1,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_token_ids=None,
    deep_k: str = "error",
    shape: dict | None = None,
    progress: bool = True,
) -> dict:
    """Plain decoding and every head at every K on `prompts` (token ids), interleaved batch
    by batch. Returns {"baseline": {...}, "runs": [one summary per (head, K)], "per_batch": [...]}."""
    shape = shape or shape_for(prompts, max_new_tokens, max(ks))
    base = SpeculativeDecoder(target, mode="none", **shape)
    runs = [
        (h, k, SpeculativeDecoder(target, h.drafter, k=k, mode=h.mode, deep_k=deep_k, **shape))
        for h in heads
        for k in ks
    ]
    kw = dict(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, stop_token_ids=stop_token_ids
    )
    batches = _batches(prompts, batch_size)
    for name, dec in [("plain", base)] + [(f"{h.label} k={k}", d) for h, k, d in runs]:  # compile outside timings
        t0 = time.perf_counter()
        dec.generate(batches[0], **kw)
        print(f"[infer] warm-up ({name}, compilation included): {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    per_batch = []
    for batch in tqdm(batches, desc=f"bench b={batch_size}", file=sys.stderr, disable=not progress):
        b = base.generate(batch, **kw)
        row = {"base": b.stats, "runs": []}
        for _, _, dec in runs:
            s = dec.generate(batch, **kw)
            same = [x == y for x, y in zip(b.tokens, s.tokens)] if temperature == 0 else None
            row["runs"].append({**s.stats, "same": same})
        per_batch.append(row)
    baseline = _totals([r["base"] for r in per_batch])
    summaries = []
    for i, (h, k, dec) in enumerate(runs):
        summary = head_summary([r["base"] for r in per_batch], [r["runs"][i] for r in per_batch], dec.k, batch_size)
        summary.update(head=h.label, mode=h.mode, k=k, prompts=len(prompts))
        summary.update(round_breakdown(dec, batches[0]))
        summary["drafter_ms"] = summary.get("drafter_ms_per_round", 0.0)
        summary["verify_ms"] = summary["target_ms_per_round"]
        summaries.append(summary)
    return {
        "batch_size": batch_size,
        "batches": len(batches),
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "baseline": baseline,
        "runs": summaries,
        "per_batch": per_batch,
    }


def _totals(stats: list[dict]) -> dict:
    new = sum(s["new_tokens"] for s in stats)
    seconds = sum(s["seconds"] for s in stats)
    return {"new_tokens": new, "seconds": seconds, "tokens_per_second": new / seconds}


def head_summary(base: list[dict], spec: list[dict], k: int, batch_size: int) -> dict:
    """One head at one K over every batch: token-weighted speeds, round-weighted acceptance."""
    b, s = _totals(base), _totals(spec)
    rounds = sum(x["rounds"] for x in spec)
    acc = sum(x["acceptance_length"] * x["rounds"] for x in spec) / max(rounds, 1)
    per_pos = [sum(x["per_position_acceptance"][i] * x["rounds"] for x in spec) / max(rounds, 1) for i in range(k)]
    same = None if spec[0]["same"] is None else [v for x in spec for v in x["same"]]
    return {
        "new_tokens": s["new_tokens"],
        "baseline_tokens_per_second": b["tokens_per_second"],
        "tokens_per_second": s["tokens_per_second"],
        "speculative_tokens_per_second": s["tokens_per_second"],
        "speedup": s["tokens_per_second"] / b["tokens_per_second"],
        "acceptance_length": acc,
        "per_position_acceptance": per_pos,
        "ms_per_round": 1000 * s["seconds"] / max(rounds / batch_size, 1),
        "greedy_mismatches": None if same is None else same.count(False),
        "identical_greedy_outputs": None if same is None else all(same),
        "median_batch_speedup": statistics.median(
            x["tokens_per_second"] / y["tokens_per_second"] for x, y in zip(spec, base)
        ),
    }


def run_bench(args, target, heads: list[Head], stop_token_ids=None) -> dict:
    """The command: `compare` on `--prompts`, a table on stdout, everything in `--json`. With
    one head and one K the summary's keys also sit at the top level (the single-drafter form)."""
    ids = source_prompt_ids(target, args.prompts, args.limit, args.max_prompt_tokens)
    result = compare(
        target,
        heads,
        args.k,
        ids,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop_token_ids=stop_token_ids,
        deep_k=args.deep_k,
    )
    result["prompts"] = args.prompts
    if len(result["runs"]) == 1:
        result.update({key: v for key, v in result["runs"][0].items() if key != "prompts"})
    _print(result)
    if args.json_out:
        try:
            atomic_write_text(args.json_out, json.dumps(result, indent=1))
        except OSError as err:  # its temporary sibling's name would mean nothing to the user
            raise OSError(f"--json {args.json_out}: cannot write it ({err.strerror or err})") from None
    return result


def _print(r: dict) -> None:
    base = r["baseline"]["tokens_per_second"]
    print(f"prompts {r['prompts']}, {r['batches']} batches of {r['batch_size']}, plain decoding {base:.2f} tokens/s")
    header = f"{'head':<24}{'mode':<10}{'K':>3}{'accept':>8}{'tok/s':>9}{'speedup':>9}{'draft ms':>10}{'verify ms':>11}"
    header += f"{'mismatch':>10}  per-position acceptance"
    print(header)
    for x in r["runs"]:
        mism = "-" if x["greedy_mismatches"] is None else f"{x['greedy_mismatches']}/{x['prompts']}"
        print(
            f"{x['head'][-23:]:<24}{x['mode']:<10}{x['k']:>3}{x['acceptance_length']:>8.3f}{x['tokens_per_second']:>9.2f}"
            f"{x['speedup']:>8.2f}x{x['drafter_ms']:>10.1f}{x['verify_ms']:>11.1f}{mism:>10}  "
            + " ".join(f"{a:.2f}" for a in x["per_position_acceptance"])
        )
    if len(r["runs"]) == 1:  # the single-drafter lines
        x = r["runs"][0]
        print(f"{'speedup':<28}{x['speedup']:.2f}x")
        if x["identical_greedy_outputs"] is not None:
            print(f"{'identical greedy outputs':<28}{x['identical_greedy_outputs']}")
