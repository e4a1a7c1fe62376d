"""What a P-EAGLE head gives when served as plain EAGLE-3 (what vLLM 0.34 and later run for a head
exported `--as eagle3`): the same trained head drafting in parallel (one pass, as trained) and in
chain mode (one token a pass, each fed the drafter's own hidden state, as EAGLE-3), side by side in
one run (`infer.compare.compare`: plain decoding and both modes at every K, interleaved batch by
batch, greedy outputs checked equal to plain decoding's).

    python -m bench.peagle_as_eagle3 --drafter runs/demo/head [--target gemma3-270m] [--k 1,2,3,4,5,6,7]
        [--prompts mtbench] [--limit 8] [--max-new-tokens 64] [--raw runs/bench/peagle_as_eagle3.json]
        [--results bench/results/peagle_as_eagle3.json]

Writes the raw `compare` output (--raw) and the results file docs/benchmarks.md renders (--results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import jax

import peagle_jax as pj
from bench.command import command_line
from infer.compare import Head, compare
from infer.load import source_prompt_ids
from peagle_jax.runtime.folders import atomic_write_text
from peagle_jax.sources.assets import ASSETS, prepare

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.peagle_as_eagle3",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--drafter", required=True, help="a trained P-EAGLE head (any format load_drafter reads)")
    ap.add_argument("--target", default="gemma3-270m", help="the head's target: an asset name or a HF folder")
    ap.add_argument("--k", default="1,2,3,4,5,6,7")
    ap.add_argument("--prompts", default="mtbench")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--raw", default="runs/bench/peagle_as_eagle3.json")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results" / "peagle_as_eagle3.json"))
    return ap.parse_args(argv)


def rows_of(result: dict, ks: list[int]) -> list[list[str]]:
    """One row per K: acceptance length and speedup of each mode, and chain / parallel."""
    by = {(r["mode"], r["k"]): r for r in result["runs"]}
    rows = []
    for k in ks:
        par, chain = by[("parallel", k)], by[("chain", k)]
        rows.append(
            [
                str(k),
                f"{par['acceptance_length']:.3f}",
                f"{chain['acceptance_length']:.3f}",
                f"{chain['acceptance_length'] / par['acceptance_length']:.3f}",
                f"{par['speedup']:.2f}x",
                f"{chain['speedup']:.2f}x",
                " ".join(f"{a:.2f}" for a in par["per_position_acceptance"]),
                " ".join(f"{a:.2f}" for a in chain["per_position_acceptance"]),
            ]
        )
    return rows


def hardware() -> str:
    model = (
        next(
            (
                ln.split(":", 1)[1].strip()
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")
            ),
            platform.machine(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.machine()
    )
    dev = jax.devices()[0]
    accel = "no accelerator" if dev.platform == "cpu" else f"{jax.device_count()} x {dev.device_kind}"
    return f"{os.cpu_count()}-core {model}, {accel}"


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def results_file(args, result: dict, ks: list[int], head) -> dict:
    mism = sum(r["greedy_mismatches"] or 0 for r in result["runs"])
    cfg = head.config
    return {
        "title": "A P-EAGLE head served as EAGLE-3: what upgrading vLLM to 0.34 costs",
        "order": 12,
        "setup": (
            f"One trained P-EAGLE head ({cfg.num_layers} layer(s), K_train {cfg.k_train}, `{args.drafter}`), "
            f"target {args.target}, float32, batch 1, greedy; {result['prompts']} {args.prompts} prompts "
            f"(at most {args.max_prompt_tokens} tokens), {args.max_new_tokens} new tokens each. "
            "`parallel`: the head as trained (all K drafts in one pass: P-EAGLE, vLLM 0.16-0.33). `chain`: the same "
            "weights drafting one token a pass from their own hidden state (EAGLE-3), which is what vLLM 0.34 "
            "and later run for the head exported `--as eagle3` (vLLM 0.34 refuses it as P-EAGLE)."
        ),
        "command": command_line("bench.peagle_as_eagle3"),
        "hardware": hardware(),
        "jax": jax.__version__,
        "commit": commit(),
        "date": datetime.date.today().isoformat(),
        "columns": [
            "K",
            "acceptance length, parallel",
            "acceptance length, as EAGLE-3 (chain)",
            "chain / parallel",
            "speedup, parallel",
            "speedup, chain",
            "per-position acceptance, parallel",
            "per-position acceptance, chain",
        ],
        "rows": rows_of(result, ks),
        "notes": [
            "Acceptance length: 1 + the drafts accepted per round, averaged over rounds (greedy, so the same on "
            "any machine). Speedup: tokens/s over plain decoding measured side by side on this CPU, where a "
            "chain round costs K drafter passes: on a GPU the ratio of the two modes' speed differs, their "
            "acceptance does not.",
            f"Greedy outputs differing from plain decoding: {mism} (every mode, K and prompt).",
            "The head was trained for parallel drafting (P-EAGLE's COD rows, mask token and shared hidden "
            "vector): drafting one token at a time, its later positions read its own hidden states, which "
            "training never fed it. A head meant for vLLM 0.34 and later is trained as EAGLE-3 "
            "(`--model.mode chain`) or DFlash.",
            *depth_note(result, ks),
        ],
    }


def depth_note(result: dict, ks: list[int]) -> list[str]:
    """A note when the head accepts almost nothing past its first draft in either mode: then the
    table cannot show what drafting one token at a time costs a head that drafts deep."""
    by = {(r["mode"], r["k"]): r for r in result["runs"]}
    k = max(ks)
    second = {m: by[(m, k)]["per_position_acceptance"][1] for m in ("parallel", "chain") if k > 1}
    if not second or max(second.values()) >= 0.1:
        return []
    return [
        f"This head accepts almost nothing past its first draft in either mode (position 2 at K = {k}: "
        f"{second['parallel']:.2f} parallel, {second['chain']:.2f} chain), so the two modes measure alike "
        "here: what serving as EAGLE-3 costs a head that drafts deep needs a head trained longer (on an "
        "accelerator) than this CPU run."
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    ks = [int(x) for x in args.k.split(",")]
    target_dir = prepare(args.target) if args.target in ASSETS else args.target
    target = pj.load_target(target_dir)
    head = pj.load_drafter(args.drafter)
    if head.config.mode != "parallel":
        raise SystemExit(f"error: {args.drafter} is a {head.config.mode!r} head; this compares a P-EAGLE head's modes")
    ids = source_prompt_ids(target, args.prompts, args.limit, args.max_prompt_tokens)
    heads = [Head("P-EAGLE as trained", head, "parallel"), Head("as EAGLE-3", head, "chain")]
    result = compare(target, heads, ks, ids, max_new_tokens=args.max_new_tokens, deep_k="warn")
    result.pop("per_batch")
    Path(args.raw).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.raw, json.dumps(result, indent=1))
    out = results_file(args, result, ks, head)
    atomic_write_text(args.results, json.dumps(out, indent=1) + "\n")
    for row in [out["columns"], *out["rows"]]:
        print(" | ".join(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
