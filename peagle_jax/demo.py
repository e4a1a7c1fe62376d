"""Greedy generation with the real Gemma-3-270M on the JAX target:

    python -m peagle_jax.demo [--prompt TEXT] [--max-new-tokens N] [--dtype float32|bfloat16]

Prepares the model folder (`peagle_jax.sources.assets.prepare("gemma3-270m")`, built once from the
PyPI GGUF package and cached), loads it with `load_target`, generates greedily with
`peagle_jax.engine.generation.generate_greedy` (the engine's plain decoding: jitted prefill +
`lax.while_loop` of decode steps) and prints the text and the
speed. The first call compiles; the speed reported is a second, warm call.
"""

from __future__ import annotations

import sys
import time

from peagle_jax.runtime.command_line import DefaultsFormatter, OneLineParser, UsageError, run

DEFAULT_PROMPT = "The three most important ideas in computer science are"


def _parser() -> OneLineParser:
    p = OneLineParser(
        prog="python -m peagle_jax.demo", description=__doc__.split("\n\n")[0], formatter_class=DefaultsFormatter
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens at most")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="target dtype")
    p.add_argument("--asset", default="gemma3-270m", help="asset name for peagle_jax.sources.assets.prepare")
    p.add_argument("--path", help="use this HF folder instead of the prepared asset")
    p.add_argument("--no-warm", action="store_true", help="run once (the speed then includes compilation)")
    return p


def _parse(argv):
    args = _parser().parse_args(argv)
    if args.max_new_tokens < 1:
        raise UsageError("python -m peagle_jax.demo: --max-new-tokens must be at least 1")
    return args


def _demo(args) -> int:
    import peagle_jax as pj
    from peagle_jax.engine import generate_greedy

    if args.path:
        folder = args.path
    else:
        from peagle_jax.sources.assets import prepare

        folder = prepare(args.asset)
    t0 = time.perf_counter()
    target = pj.load_target(folder, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    tok = target.tokenizer
    if tok is None:
        raise ValueError(f"{folder}: no tokenizer files")
    ids = tok(args.prompt)["input_ids"]
    print(
        f"# {target!r}: loaded in {load_s:.1f}s; prompt {len(ids)} tokens; eos {list(target.eos_token_ids)}",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    new = generate_greedy(target, [ids], args.max_new_tokens)[0]  # stops at config + generation-config eos
    first_s = seconds = time.perf_counter() - t0
    if not args.no_warm:
        t0 = time.perf_counter()
        new = generate_greedy(target, [ids], args.max_new_tokens)[0]
        seconds = time.perf_counter() - t0
    print(args.prompt + tok.decode(new, skip_special_tokens=True))
    what = "first call, with compilation" if args.no_warm else f"warm call; first call {first_s:.1f}s with compilation"
    print(
        f"# {len(new)} new tokens in {seconds:.2f}s = {len(new) / seconds:.1f} tokens/s (prefill + decode, {what})",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(argv, _parse, _demo)


if __name__ == "__main__":
    sys.exit(main())
