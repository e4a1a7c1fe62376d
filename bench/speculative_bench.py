"""Cost of one speculative round on the real Gemma-3-270M target, this machine, batch 1.

For K in 1, 3, 5, 7 and both drafting modes (parallel = P-EAGLE, one drafter pass; chain =
EAGLE-3, K passes) it times, side by side in one run: the drafter alone, the target's
verification of K+1 tokens alone, a whole round, and one plain decode step (mode none).
Speedup at acceptance length AL = AL * plain_step / round, so the break-even acceptance
length is round / plain_step.

    python bench/speculative_bench.py [--json bench/results/speculative_bench.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import peagle_jax as pj
from infer.api import SpeculativeDecoder
from peagle_jax import speculative as sp
from peagle_jax.assets import prepare

PROMPT = ("Explain, step by step, how a speculative decoding system uses a small draft model "
          "to propose several tokens that a large target model then verifies in one pass.")


@functools.partial(jax.jit, static_argnums=(0, 1))
def _draft_only(cfg, ddef, dstate, tokens, aux, positions, bonus_slot, cache):
    return sp._draft(cfg, nnx.merge(ddef, dstate), tokens, aux, positions, bonus_slot, cache)[0]


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


def _round_ms(dec: SpeculativeDecoder, reps: int) -> float:
    cfg, _, state = dec.prefill([PROMPT], max_new_tokens=4 * reps * (dec.k + 1) + 8)
    tdef, tstate, ddef, dstate = dec._modules()
    state = sp.jit_round(cfg, tdef, tstate, ddef, dstate, state)  # compile
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        state = jax.block_until_ready(sp.jit_round(cfg, tdef, tstate, ddef, dstate, state))
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def measure(target, drafters, ks, reps: int) -> dict:
    """drafters: {(mode, draft vocab size): Drafter}."""
    plain = _round_ms(SpeculativeDecoder(target, None, mode="none"), reps)
    rows = []
    for (mode, vd), drafter in drafters.items():
        for k in ks:
            dec = SpeculativeDecoder(target, drafter, k=k, mode=mode, deep_k="warn")
            cfg, _, state = dec.prefill([PROMPT], max_new_tokens=64)
            tdef, tstate, ddef, dstate = dec._modules()
            b = state.last.shape[0]
            slots = jnp.arange(k + 1)[None, :]
            positions = state.length[:, None] + slots
            tokens = jnp.concatenate([state.last[:, None], state.drafts], axis=1)
            aux = jnp.zeros((b, k + 1, 3 * target.config.hidden_size), _dtype(target))
            n = jnp.full((b,), k // 2, jnp.int32)  # half the drafts accepted
            draft_pos = jnp.where(slots <= n[:, None], positions, -1)
            drafter_ms = _median_ms(lambda: _draft_only(cfg, ddef, dstate, tokens, aux, draft_pos, n,
                                                        state.drafter_cache), reps)
            verify_ms = _median_ms(lambda: _verify_only(cfg, tdef, tstate, tokens, positions,
                                                        state.target_cache), reps)
            round_ms = _round_ms(dec, reps)
            rows.append({"mode": mode, "draft_vocab": vd, "k": k, "drafter_ms": drafter_ms, "verify_ms": verify_ms,
                         "round_ms": round_ms, "break_even_acceptance_length": round_ms / plain,
                         "speedup_at_acceptance_3": 3 * plain / round_ms})
    return {"plain_decode_step_ms": plain, "rounds": rows}


def _dtype(handle):
    return next(x.dtype for x in jax.tree.leaves(handle.state) if jnp.issubdtype(x.dtype, jnp.floating))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="bench/results/speculative_bench.json")
    ap.add_argument("--ks", default="1,3,5,7")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=1, help="drafter layers")
    ap.add_argument("--draft-vocabs", default="262144,32768",
                    help="draft vocabulary sizes (the first N ids: timing only depends on the size)")
    args = ap.parse_args()
    target = pj.load_target(prepare("gemma3-270m"), dtype="float32")
    v = target.config.vocab_size
    drafters = {(mode, vd): pj.new_drafter(target, num_layers=args.layers, mode=mode, seed=0,
                                            draft_vocab=None if vd >= v else np.arange(vd))
                for vd in (int(x) for x in args.draft_vocabs.split(",")) for mode in ("parallel", "chain")}
    result = measure(target, drafters, [int(k) for k in args.ks.split(",")], args.reps)
    result.update(device=str(jax.devices()[0]), drafter_layers=args.layers, batch=1)
    print(f"plain decode step: {result['plain_decode_step_ms']:.1f} ms")
    print(f"{'mode':<10}{'Vd':>8}{'K':>3}{'drafter ms':>12}{'verify ms':>11}{'round ms':>10}{'break-even AL':>15}"
          f"{'speedup@AL3':>13}")
    for r in result["rounds"]:
        print(f"{r['mode']:<10}{r['draft_vocab']:>8}{r['k']:>3}{r['drafter_ms']:>12.2f}{r['verify_ms']:>11.2f}{r['round_ms']:>10.2f}"
              f"{r['break_even_acceptance_length']:>15.2f}{r['speedup_at_acceptance_3']:>13.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
