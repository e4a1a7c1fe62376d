"""`python -m infer generate|bench|cost|serve`: speculative decoding from the command line.

Exit status: 0 ok, 1 the work failed (a folder, file or value the command could not use),
2 a usage error. Errors are one line on stderr; progress lines go to stderr, results to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from infer.flags import add_mesh_flags, add_model_flags, k_list, mode_list
from infer.load import (
    check_mesh,
    load_head,
    load_target,
    new_head_layers,
    status,
    synthetic_lengths,
    target_config,
)
from infer.serve.cli import add_serve_args, dist_problem, join_processes, run_serve
from peagle_jax.runtime.command_line import (
    DefaultsFormatter,
    OneLineParser,
    UsageError,
    exit_interrupted,
    number_type,
    positive_int,
    run,
    terminate_as_interrupt,
)

Formatter = DefaultsFormatter


non_negative_float = number_type(float, 0.0, 1e30, "a finite number >= 0")
probability = number_type(float, 1e-30, 1.0, "a number in (0, 1]")
SEED_MAX = 2**63 - 1  # = peagle_jax.engine.generation.SEED_MAX (jax.random.key's int64); not imported: no JAX yet
seed_int = number_type(int, 0, SEED_MAX, "an integer in [0, 2**63 - 1] (what jax.random.key accepts)")


def _common(p: argparse.ArgumentParser, bench: bool = False) -> None:
    add_model_flags(p, several=bench)
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="new tokens per prompt at most")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=seed_int, default=0, help="sampling seed, in [0, 2**63 - 1]")
    p.add_argument(
        "--stop-token-ids",
        metavar="IDS",
        type=stop_ids_arg,
        help="extra stop token ids, comma separated "
        "(added to the target's eos ids from config.json and generation_config.json)",
    )


def parse_args(argv=None) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m infer", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser, metavar="COMMAND")
    gen = sub.add_parser(
        "generate",
        help="generate from one prompt (text or token ids)",
        formatter_class=Formatter,
        description="Generate from one prompt and print the text (or JSON with --json).",
    )
    _common(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text (the chat template is applied when the target has one)")
    prompt.add_argument(
        "--prompt-ids",
        metavar="IDS",
        help="token ids, comma separated (a target without a "
        "tokenizer), or a .jsonl file with one list of ids per line",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    bench = sub.add_parser(
        "bench",
        help="baseline vs speculative decoding on a prompt set",
        formatter_class=Formatter,
        description="Plain decoding and one or more drafter heads (at one or more K) on the same "
        "prompts, interleaved batch by batch, with speedup and acceptance statistics.",
    )
    _common(bench, bench=True)
    bench.add_argument(
        "--prompts",
        default="mtbench",
        help="mtbench | humaneval | a JSONL file | synthetic:LENGTHS (random token ids, e.g. synthetic:128,1024: "
        "no tokenizer needed, --limit of them, 8 by default)",
    )
    bench.add_argument("--limit", type=positive_int, default=None, help="use the first N prompts (default: all)")
    bench.add_argument(
        "--max-prompt-tokens", type=positive_int, default=None, help="leave out longer prompts (default: none)"
    )
    bench.add_argument("--batch-size", type=positive_int, default=1, help="prompts decoded together")
    bench.add_argument("--json", dest="json_out", metavar="FILE", help="write all results to this file")
    _cost_parser(sub)
    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server (continuous batching)",
        formatter_class=Formatter,
        description="Serve /v1/completions and /v1/chat/completions (streaming or not), /v1/models, /health "
        "and /metrics, decoding up to --max-batch requests together.",
    )
    add_serve_args(serve)
    args = parser.parse_args(argv)
    if args.command == "cost":
        return _check_cost(parser, args)
    for folder in args.drafter if isinstance(args.drafter, list) else [args.drafter]:
        if folder and folder.startswith("new:") and new_head_layers(folder) is None:
            parser.error(f"--drafter {folder}: expected new or new:LAYERS (LAYERS a positive integer)")
    if args.mode != "none" and not args.drafter:
        parser.error(
            f"--mode {args.mode} needs --drafter DIR" if args.mode else "--drafter DIR is needed (or --mode none)"
        )
    if args.command == "bench" and args.drafter and len(set(args.drafter)) != len(args.drafter):
        parser.error("--drafter: the same folder is given twice")
    if args.command == "bench" and args.json_out:
        from peagle_jax.runtime.folders import unwritable

        why = unwritable(Path(args.json_out), "file")
        if why:
            parser.error(f"--json {args.json_out}: {why}")
    if args.command == "bench" and not _prompt_source(args.prompts):
        parser.error(
            f"--prompts {args.prompts!r}: neither mtbench, humaneval, an existing JSONL file nor synthetic:LENGTHS "
            "(positive integers, comma separated)"
        )
    if args.command in ("generate", "bench", "serve"):
        _check_paths(parser, args)
    if args.command == "serve" and dist_problem(args):
        parser.error(dist_problem(args))
    return args


def _cost_parser(sub) -> None:
    cost = sub.add_parser(
        "cost",
        help="what a round costs on this device, and the acceptance length that pays it",
        formatter_class=Formatter,
        description="Per (mode, K, batch): the plain decode step and its HBM roofline, the round, the drafter and "
        "the verification alone, the break-even acceptance length (round / step), compile seconds; synthetic "
        "prompts, so it runs on dummy weights with no tokenizer.",
    )
    cost.add_argument("--target", required=True, metavar="DIR", help="target folder, Hub id or (dummy) preset")
    cost.add_argument("--load-format", default="auto", choices=["auto", "dummy"], help="dummy: random weights")
    cost.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="target dtype")
    cost.add_argument(
        "--drafter",
        default="new",
        metavar="DIR",
        help="a head folder, or new[:LAYERS]: a fresh random head of the default shape per mode",
    )
    cost.add_argument(
        "--modes",
        type=mode_list,
        default=None,
        help="parallel,chain,dflash (default: the head's own mode; with new: parallel,chain)",
    )
    cost.add_argument("--k", type=k_list, default=[1, 3, 5, 7], help="drafts per round")
    cost.add_argument("--batch", type=k_list, default=[1], help="batch sizes (1,16)")
    cost.add_argument(
        "--prompt-len", type=k_list, default=[1024], help="prompt tokens before the timed rounds (4096,32768)"
    )
    cost.add_argument("--reps", type=positive_int, default=10, help="timed calls per program (medians)")
    cost.add_argument("--json", dest="json_out", metavar="FILE", help="write the results here (after every row)")
    add_mesh_flags(cost)


def _check_cost(parser, args) -> argparse.Namespace:
    if args.drafter.startswith("new") and new_head_layers(args.drafter) is None and not Path(args.drafter).exists():
        parser.error(f"--drafter {args.drafter}: expected a head folder, new or new:LAYERS")
    if args.json_out:
        from peagle_jax.runtime.folders import unwritable

        why = unwritable(Path(args.json_out), "file")
        if why:
            parser.error(f"--json {args.json_out}: {why}")
    return args


def _check_paths(parser, args) -> None:
    """The folders and files the flags name, judged before anything loads: a path that exists,
    or a Hub id (org/name) to download."""
    from peagle_jax.sources.hub import is_repo_id

    drafters = args.drafter if isinstance(args.drafter, list) else [args.drafter]
    heads = [d for d in drafters if d and new_head_layers(d) is None]  # new[:LAYERS]: a fresh head
    for flag, value in [("--target", args.target), *(("--drafter", d) for d in heads)]:
        if not (Path(value).expanduser().exists() or is_repo_id(value) or _dummy_preset(args, flag, value)):
            also = ", nor a preset (--load-format dummy)" if flag == "--target" else ""
            parser.error(f"{flag} {value}: no such folder, nor a Hub id (org/name){also}")
    ids = getattr(args, "prompt_ids", None)
    if ids and Path(ids).suffix == ".jsonl" and not Path(ids).is_file():
        parser.error(f"--prompt-ids {ids}: no such file")


def _dummy_preset(args, flag: str, value: str) -> bool:
    """A preset target (`peagle_jax.models.presets`), which only dummy weights can stand for."""
    if flag != "--target" or args.load_format != "dummy":
        return False
    from peagle_jax.models.presets import preset_fields

    return preset_fields(value) is not None


def _prompt_source(name: str) -> bool:
    """A set `peagle_jax.engine.prompts.load_prompts` knows, or a file (judged before the target loads)."""
    from peagle_jax.engine.prompts import PROMPT_SETS

    if name.startswith("synthetic:"):
        return synthetic_lengths(name) is not None
    return name.lower().replace("-", "").replace("_", "") in PROMPT_SETS or Path(name).expanduser().is_file()


def _ids(text: str, flag: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated token ids, got {text!r}") from None
    if not ids:
        raise ValueError(f"{flag}: no token ids in {text!r}")
    return ids


def stop_ids_arg(text: str) -> list[int]:
    """An argparse type: `--stop-token-ids` "1,2,3" (checked against the vocabulary once it is known)."""
    try:
        return _ids(text, "--stop-token-ids")
    except ValueError as err:  # argparse names the flag itself
        raise argparse.ArgumentTypeError(str(err).split(": ", 1)[1]) from None


def read_prompt_ids(value: str) -> list[list[int]]:
    """`--prompt-ids`: "1,2,3", or a .jsonl file holding one JSON list of ids per line."""
    path = Path(value)
    if not path.suffix == ".jsonl":
        return [_ids(value, "--prompt-ids")]
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
            if not isinstance(row, list) or not row or not all(isinstance(t, int) for t in row):
                raise ValueError(f"{path}:{lineno}: expected a non-empty JSON list of token ids")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def _load(args, prompt_ids=()):
    """(target, [(label, drafter)], stop ids): the drafters of --drafter (a folder, or `new[:LAYERS]`:
    a fresh head in --mode, parallel by default), none with --mode none. The stop ids and
    `prompt_ids` are checked against the target's vocabulary (its config.json) before any
    weight is read."""
    from peagle_jax.engine import check_vocab

    t0 = time.perf_counter()
    vocab = target_config(args).vocab_size
    check_vocab(args.stop_token_ids or [], vocab, "--stop-token-ids")
    for i, row in enumerate(prompt_ids):
        check_vocab(row, vocab, "--prompt-ids" + (f" (prompt {i + 1})" if len(prompt_ids) > 1 else ""))
    target = load_target(args)
    folders = [] if args.mode == "none" else args.drafter
    folders = [folders] if isinstance(folders, str) else folders
    drafters = [(folder, load_head(folder, target, args.mode or "parallel")) for folder in folders]
    status(f"loaded {target!r}" + "".join(f" and {d!r}" for _, d in drafters) + f" in {time.perf_counter() - t0:.1f}s")
    return target, drafters, args.stop_token_ids


def run_generate(args) -> None:
    from peagle_jax.engine import SpeculativeDecoder

    prompts = [args.prompt] if args.prompt is not None else read_prompt_ids(args.prompt_ids)
    target, drafters, stops = _load(args, [] if args.prompt is not None else prompts)
    drafter = drafters[0][1] if drafters else None
    mode = args.mode or drafter.config.mode
    dec = SpeculativeDecoder(target, drafter, k=args.k, mode=mode, deep_k=args.deep_k)
    status("compiling and generating (the first call compiles) ...")
    res = dec.generate(
        prompts,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop_token_ids=stops,
    )
    if args.json:
        rows = [{"tokens": t, "text": res.texts[i] if res.texts else None} for i, t in enumerate(res.tokens)]
        print(json.dumps({**rows[0], "stats": res.stats} if len(rows) == 1 else {"outputs": rows, "stats": res.stats}))
    else:
        for i, t in enumerate(res.tokens):
            print(res.texts[i] if res.texts else t)
        s = res.stats
        status(
            f"{s['new_tokens']} tokens in {s['seconds']:.1f}s (compilation included), acceptance length "
            f"{s['acceptance_length']:.2f}"
        )


def check_k(args) -> None:
    """--k against the target's context (config.json) before anything loads or compiles; the
    decoder checks it again (DepthError). An unreadable config is left to the loader to report."""
    from peagle_jax.engine import check_depth
    from peagle_jax.formats import target_facts

    if getattr(args, "mode", None) == "none":
        return
    try:
        limit = target_facts(args.target)["max_position_embeddings"]
    except (ValueError, OSError):
        return
    check_depth(max(args.k) if isinstance(args.k, list) else args.k, None, limit)


def _work(args) -> int:
    from peagle_jax.engine import DepthError

    try:
        return _dispatch(args)
    except DepthError as err:
        raise UsageError(f"--k: {err}") from None


def _dispatch(args) -> int:
    from peagle_jax.runtime.compile_cache import enable_compile_cache

    check_k(args)
    if args.command == "serve":
        join_processes(args)  # before check_mesh: the mesh flags count every process's devices
    check_mesh(args)
    args.compile_cache = enable_compile_cache()  # before the first compile
    if args.command == "cost":
        from infer import cost

        cost.run(args)
        return 0
    if args.command == "serve":
        return run_serve(args)
    if args.command == "generate":
        run_generate(args)
        return 0
    from infer.compare import Head, run_bench

    target, drafters, stops = _load(args)
    if args.mode == "none":
        heads = [Head("plain", None, "none")]
    else:
        heads = [Head(folder, d, args.mode or d.config.mode) for folder, d in drafters]
    run_bench(args, target, heads, stops)
    return 0


def main(argv=None) -> int:
    terminate_as_interrupt("interrupted")  # first: run() installs it again, an interrupt before that is one too
    try:
        return run(argv, parse_args, _work, starting="interrupted")  # nothing to clean up before a write
    except KeyboardInterrupt:  # landed between the handlers' installation and run's own frame
        exit_interrupted("interrupted")


if __name__ == "__main__":
    sys.exit(main())
