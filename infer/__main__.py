"""`python -m infer generate|bench`: speculative decoding from the command line.

Errors print one line to stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="Hugging Face folder of the target model")
    p.add_argument("--drafter", help="drafter checkpoint (ours, vLLM or speculators folder)")
    p.add_argument("--k", type=int, default=7, help="drafts per round (default 7)")
    p.add_argument("--mode", default="parallel", choices=["parallel", "chain", "none"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deep-k", default="error", choices=["error", "warn"],
                   help="k above the drafter's trained depth: fail or warn")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m infer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from one prompt")
    _common(gen)
    gen.add_argument("--prompt", required=True, help="text (the chat template is applied when the target has one)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    bench = sub.add_parser("bench", help="baseline vs speculative decoding on a prompt set")
    _common(bench)
    bench.add_argument("--prompts", default="mtbench", help="mtbench | humaneval | a JSONL file")
    bench.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    bench.add_argument("--batch-size", type=int, default=1)
    bench.add_argument("--json", dest="json_out", help="write all results to this file")
    return parser.parse_args(argv)


def _load(args):
    import peagle_jax as pj
    from infer.api import SpeculativeDecoder

    target = pj.load_target(args.target, dtype=args.dtype)
    drafter = None
    if args.mode != "none":
        if not args.drafter:
            raise ValueError(f"--mode {args.mode} needs --drafter")
        drafter = pj.load_drafter(args.drafter)
    return target, drafter, lambda mode: SpeculativeDecoder(target, drafter, k=args.k, mode=mode,
                                                            deep_k=args.deep_k)


def run_generate(args) -> None:
    _, _, make = _load(args)
    res = make(args.mode).generate([args.prompt], max_new_tokens=args.max_new_tokens,
                                   temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if args.json:
        print(json.dumps({"tokens": res.tokens[0], "text": res.texts[0] if res.texts else None,
                          "stats": res.stats}))
    else:
        print(res.texts[0] if res.texts else res.tokens[0])
        s = res.stats
        print(f"[{s['new_tokens']} tokens, {s['tokens_per_second']:.1f} tok/s, "
              f"acceptance length {s['acceptance_length']:.2f}]", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "generate":
            run_generate(args)
        else:
            from infer.bench import run_bench

            run_bench(args, *_load(args))
    except (ValueError, OSError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
