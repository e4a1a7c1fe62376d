"""Cost of one speculative round on the real Gemma-3-270M target, this machine, batch 1.

For K in 1, 3, 5, 7 and both drafting modes (parallel = P-EAGLE, one drafter pass; chain =
EAGLE-3, K passes) it times, side by side in one run: the drafter alone, the target's
verification of K+1 tokens alone, a whole round, and one plain decode step (mode none).
Speedup at acceptance length AL = AL * plain_step / round, so the break-even acceptance
length is round / plain_step.

    python bench/speculative_bench.py [--json runs/bench/speculative_bench.json]
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import numpy as np

import peagle_jax as pj
from infer.api import SpeculativeDecoder
from infer.bench import round_breakdown, round_ms
from peagle_jax.assets import prepare

PROMPT = (
    "Explain, step by step, how a speculative decoding system uses a small draft model "
    "to propose several tokens that a large target model then verifies in one pass."
)


def measure(target, drafters, ks, reps: int) -> dict:
    """drafters: {(mode, draft vocab size): Drafter}."""
    plain = round_ms(SpeculativeDecoder(target, None, mode="none"), PROMPT, reps)
    rows = []
    for (mode, vd), drafter in drafters.items():
        for k in ks:
            dec = SpeculativeDecoder(target, drafter, k=k, mode=mode, deep_k="warn")
            parts = round_breakdown(dec, PROMPT, reps)
            whole = round_ms(dec, PROMPT, reps)
            rows.append(
                {
                    "mode": mode,
                    "draft_vocab": vd,
                    "k": k,
                    "drafter_ms": parts["drafter_ms_per_round"],
                    "verify_ms": parts["target_ms_per_round"],
                    "round_ms": whole,
                    "break_even_acceptance_length": whole / plain,
                    "speedup_at_acceptance_3": 3 * plain / whole,
                }
            )
    return {"plain_decode_step_ms": plain, "rounds": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="runs/bench/speculative_bench.json")
    ap.add_argument("--ks", default="1,3,5,7")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=1, help="drafter layers")
    ap.add_argument(
        "--draft-vocabs",
        default="262144,32768",
        help="draft vocabulary sizes (the first N ids: timing only depends on the size)",
    )
    args = ap.parse_args()
    target = pj.load_target(prepare("gemma3-270m"), dtype="float32")
    v = target.config.vocab_size
    drafters = {
        (mode, vd): pj.new_drafter(
            target, num_layers=args.layers, mode=mode, seed=0, draft_vocab=None if vd >= v else np.arange(vd)
        )
        for vd in (int(x) for x in args.draft_vocabs.split(","))
        for mode in ("parallel", "chain")
    }
    result = measure(target, drafters, [int(k) for k in args.ks.split(",")], args.reps)
    result.update(device=str(jax.devices()[0]), drafter_layers=args.layers, batch=1)
    print(f"plain decode step: {result['plain_decode_step_ms']:.1f} ms")
    print(
        f"{'mode':<10}{'Vd':>8}{'K':>3}{'drafter ms':>12}{'verify ms':>11}{'round ms':>10}{'break-even AL':>15}"
        f"{'speedup@AL3':>13}"
    )
    for r in result["rounds"]:
        print(
            f"{r['mode']:<10}{r['draft_vocab']:>8}{r['k']:>3}{r['drafter_ms']:>12.2f}{r['verify_ms']:>11.2f}{r['round_ms']:>10.2f}"
            f"{r['break_even_acceptance_length']:>15.2f}{r['speedup_at_acceptance_3']:>13.2f}"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
