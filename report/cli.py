"""`python -m report`: P-EAGLE vs EAGLE-3 vs DFlash vs plain decoding, from one resumable command.

Stages (each records itself in WORK/stages/NAME.json, written atomically when it finishes; a
rerun with the same settings reuses every finished stage, and an interrupted training resumes
from the trainer's last checkpoint):
  data            `python -m train ... --data.prepare_only true`: prepares the
                  target, loads and checks the data, and with --regenerate replaces the answers
                  by the target's own greedy continuations (cached in WORK/data/regenerated.jsonl)
  train-parallel  `python -m train --model.mode parallel` (P-EAGLE),
  train-chain     `--model.mode chain` (EAGLE-3) and
  train-dflash    `--model.mode dflash --model.block_size MAX_K+1` (DFlash: one block drafts every K):
                  same data, same steps (= token budget), same head size; the regenerated answers
                  are copied in, so nothing is regenerated twice
  eval-SET-bB     plain decoding and every head at every K on the SET prompts at batch B,
                  interleaved batch by batch (`infer.compare.compare`, the code of `python -m infer bench`);
                  a record made with other heads (a two-head run's) is redone
Then OUT/results.json, OUT/*.png and OUT.md (the report beside the folder) are written from the
stage records; OUT is replaced whole, so it is never half-written.

The trainer runs as a subprocess (`python -m train`, the command each stage records), the engine in
this process (`infer.compare`).
`--smoke` runs the same stages on the trainer's tiny preset (a random tiny target) in seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from peagle_jax.runtime.command_line import DefaultsFormatter, OneLineParser, run
from peagle_jax.runtime.folders import atomic_folder, atomic_write_text, check_destination
from report.common import HEADS, log
from report.evaluate import collect, stage_eval
from report.plots import plots
from report.render import markdown
from report.stages import Stages, stage_data, stage_train

# what --smoke changes (the trainer's tiny preset) against the default run on Gemma-3-270M
PROFILES = {
    "default": dict(
        steps=200, batch_size=1, heldout=4, train_flags=[], regenerate_tokens=128, prompts_per_set=8,
        max_new_tokens=64, ks="1,3,5,7", batches="1,4", max_prompt_tokens=256,
    ),
    "smoke": dict(
        steps=4, batch_size=2, heldout=0, train_flags=["--preset", "tiny", "--model.k_train", "2"],
        regenerate_tokens=8, prompts_per_set=2, max_new_tokens=8, ks="1,2", batches="1,2", max_prompt_tokens=128,
    ),
}  # fmt: skip


def int_list(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected positive integers, comma separated, got {text!r}") from None
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct positive integers, comma separated, got {text!r}")
    return sorted(values)


def positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
        if not 0 < value < 1e9:
            raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
        return value

    return parse


class Formatter(DefaultsFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the module docstring's layout and shows the defaults."""


def by_profile(key: str) -> str:
    return f"(default {PROFILES['default'][key]}; --smoke {PROFILES['smoke'][key]})"


def parser() -> OneLineParser:
    p = OneLineParser(prog="python -m report", description=__doc__, formatter_class=Formatter)
    p.add_argument("--smoke", action="store_true", help="the tiny preset (random tiny target): the pipeline in seconds")
    p.add_argument(
        "--target", default=None, help="target: an asset name or a Hugging Face folder (default gemma3-270m)"
    )
    p.add_argument(
        "--budget",
        type=positive(float),
        default=1.0,
        help="scales the training steps of every head (steps: 200 x budget; --smoke 4 x budget)",
    )
    p.add_argument(
        "--regenerate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="train on the target's own greedy answers to the ShareGPT prompts (the trainer's --data.regenerate)",
    )
    for flag, key, what in (
        ("--prompts-per-set", "prompts_per_set", "prompts of each set evaluated "),
        ("--max-new-tokens", "max_new_tokens", "new tokens per prompt "),
        ("--max-prompt-tokens", "max_prompt_tokens", "longer prompts are left out "),
    ):
        p.add_argument(flag, type=positive(int), default=None, help=what + by_profile(key))
    p.add_argument("--ks", type=int_list, default=None, help="drafts per round evaluated " + by_profile("ks"))
    p.add_argument("--batches", type=int_list, default=None, help="batch sizes evaluated " + by_profile("batches"))
    p.add_argument("--out", default=None, help="results folder (default docs/report); the report is OUT.md beside it")
    p.add_argument(
        "--work",
        default=None,
        help="stage records, data and trained heads; rerun with the same one to resume (default runs/report; "
        "--smoke: a fresh temporary folder unless given)",
    )
    return p


def resolve(p: OneLineParser, args: argparse.Namespace) -> argparse.Namespace:
    """The profile's values for every flag not given, and the folders."""
    profile = PROFILES["smoke" if args.smoke else "default"]
    if args.smoke and args.target is not None:
        p.error("--target: --smoke always uses the tiny preset's random target")
    args.target = "tiny" if args.smoke else (args.target or "gemma3-270m")
    for key in ("prompts_per_set", "max_new_tokens", "max_prompt_tokens"):
        if getattr(args, key) is None:
            setattr(args, key, profile[key])
    args.ks = args.ks or int_list(profile["ks"])
    args.batches = args.batches or int_list(profile["batches"])
    args.steps = max(1, round(profile["steps"] * args.budget))
    args.batch_size, args.heldout, args.train_flags = profile["batch_size"], profile["heldout"], profile["train_flags"]
    args.regenerate_tokens = profile["regenerate_tokens"]
    if args.smoke and args.out is not None and "docs" in Path(args.out).absolute().parts:
        p.error("--out: a smoke run never writes into docs/ (its numbers come from a random tiny target)")
    if args.smoke and (args.out is None or args.work is None):
        tmp = Path(tempfile.mkdtemp(prefix="peagle-report-smoke-"))
        args.out = args.out or str(tmp / "report")
        args.work = args.work or str(tmp / "work")
    args.out = args.out or "docs/report"
    args.work = args.work or "runs/report"
    return args


def parse_args(argv=None) -> argparse.Namespace:
    p = parser()
    args = resolve(p, p.parse_args(argv))
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def write_report(args, results: dict) -> Path:
    """OUT (results.json + plots) replaced whole, then OUT.md."""
    out = Path(args.out).absolute()
    check_destination(out, overwrite=True, marker="results.json")
    with atomic_folder(out) as tmp:
        results["plots"] = plots(results, tmp)
        atomic_write_text(tmp / "results.json", json.dumps(results, indent=1))
    md = out.with_name(out.name + ".md")
    atomic_write_text(md, markdown(results, out.name))
    return md


def make_report(args) -> int:
    t0 = time.perf_counter()
    work = Path(args.work).absolute()
    stages = Stages(work)
    data = stage_data(args, stages, work)
    trained = {mode: stage_train(args, stages, work, data, mode) for mode in HEADS}
    evals = stage_eval(args, stages, data, trained)
    results = collect(args, data, trained, evals, time.perf_counter() - t0)
    md = write_report(args, results)
    log(f"wrote {md} and {Path(args.out).absolute() / 'results.json'} in {time.perf_counter() - t0:.0f} s")
    return 0


def main(argv=None) -> int:
    return run(argv, parse_args, make_report)
