"""Decode step and speculative round time against the filled length of a fixed KV cache.

Gemma-3-270M, float32, a 32k-slot cache (per layer [B, 32768, 1, 256]); the cache holds
`filled` tokens (the state's length is set directly: the cost of a step does not depend on
the values, and a real 16k-token prefill would need a [16k, 32k] dense mask). For each filled
length, side by side in one run: the old path (dense attention over every cache slot) and the
new one (`kernels.decode`: only the blocks up to the longest filled length, or inside a sliding
layer's window). The reference row is the same step in a 512-slot cache at 256 filled tokens.

    python -m bench.decode_bench [--filled 256,1024,4096,16384] [--batch 1,4] [--reps 5] [--modes none,parallel]
        [--json runs/bench/decode_bench.json]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import peagle_jax as pj
from peagle_jax.engine import SpeculativeDecoder
from peagle_jax.engine import speculative as sp
from peagle_jax.models import layers
from peagle_jax.runtime.folders import atomic_write_text
from peagle_jax.runtime.timing import timed
from peagle_jax.sources.assets import prepare

CACHE = 32768


def step_ms(dec: SpeculativeDecoder, batch: int, filled: int, reps: int) -> float:
    """Median ms of one jitted round (mode none: one decode step) with `filled` tokens cached."""
    cfg, _, state = dec.start([[2, 3, 4, 5]] * batch, max_new_tokens=4)
    shape = state.length.shape  # the state is donated each round: build fresh arrays every time
    state = state._replace(length=jnp.full(shape, filled, jnp.int32), budget=jnp.full(shape, 10**6, jnp.int32))
    mods = dec.modules()
    box = [state]

    def step():
        box[0] = box[0]._replace(length=jnp.full(shape, filled, jnp.int32))  # stay at `filled`
        box[0] = sp.jit_round(cfg, *mods, box[0])
        return box[0]

    return timed(step, reps).ms  # the first call compiles


def measure(target, drafter, batches, filled_lengths, reps, modes=("none", "parallel")) -> list[dict]:
    rows = []
    for batch in batches:
        for mode, k in ((m, 0 if m == "none" else 7) for m in modes):
            for path in ("dense", "decode"):
                layers.CACHE_ATTENTION = path
                jax.clear_caches()
                small = SpeculativeDecoder(target, drafter, k=max(k, 1), mode=mode, cache_len=512, deep_k="warn")
                big = SpeculativeDecoder(target, drafter, k=max(k, 1), mode=mode, cache_len=CACHE, deep_k="warn")
                ref = step_ms(small, batch, 256, reps)
                for filled in filled_lengths:
                    ms = step_ms(big, batch, filled, reps)
                    rows.append(
                        {
                            "batch": batch,
                            "mode": mode,
                            "k": k,
                            "path": path,
                            "filled": filled,
                            "cache": CACHE,
                            "ms": ms,
                            "ms_in_512_cache_at_256": ref,
                            "ratio_to_512_cache": ms / ref,
                        }
                    )
                    print(
                        f"batch {batch} {mode:<8} {path:<6} filled {filled:>6}: {ms:8.1f} ms "
                        f"({ms / ref:.2f}x the 512-slot cache)",
                        flush=True,
                    )
    layers.CACHE_ATTENTION = "decode"
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.decode_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--filled", default="256,1024,4096,16384")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--modes", default="none,parallel", help="none = a plain decode step, parallel = a K=7 round")
    ap.add_argument("--json", default="runs/bench/decode_bench.json")
    args = ap.parse_args()
    target = pj.load_target(prepare("gemma3-270m"), dtype="float32")
    drafter = pj.new_drafter(target, mode="parallel", draft_vocab=list(range(32768)), seed=0)
    batches, filled = [int(b) for b in args.batch.split(",")], [int(f) for f in args.filled.split(",")]
    rows = measure(target, drafter, batches, filled, args.reps, modes=args.modes.split(","))
    atomic_write_text(args.json, json.dumps({"device": str(jax.devices()[0]), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
