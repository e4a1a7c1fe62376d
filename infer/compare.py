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
import json
import statistics
import sys
import time

from tqdm import tqdm

from infer.load import mesh_record, source_prompt_ids
from peagle_jax.engine import SpeculativeDecoder
from peagle_jax.engine import cache as kv
from peagle_jax.engine.costs import round_breakdown
from peagle_jax.runtime.folders import atomic_write_text


@dataclasses.dataclass
class Head:
    """A drafter under test: its label in tables, the loaded drafter, and its mode."""

    label: str
    drafter: object
    mode: str


def _batches(items, size):
    return [items[i : i + size] for i in range(0, len(items), size)]


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
    result["mesh"] = mesh_record(target.mesh)
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
