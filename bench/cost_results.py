"""One `python -m infer cost --json RAW` run as a results file of bench/results/ (rendered into
docs/benchmarks.md by `python -m bench.render_results`): a row per (mode, K, batch, prompt length), the plain
step and its roofline in the notes.

    python -m bench.cost_results RAW.json --out bench/results/NAME.json --title TITLE --order N \\
        --setup TEXT --hardware TEXT [--note TEXT ...] [--design docs/design/NOTE.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = ["mode", "K", "batch", "prompt", "drafter ms", "verify ms", "round ms", "break-even AL", "round compile s"]


def rows(raw: dict) -> list[list[str]]:
    return [
        [
            r["mode"],
            str(r["k"]),
            str(r["batch"]),
            str(r["prompt_len"]),
            f"{r['drafter_ms']:.2f}",
            f"{r['verify_ms']:.2f}",
        ]
        + [f"{r['round_ms']:.2f}", f"{r['break_even_acceptance_length']:.2f}", f"{r['round_compile_s']:.1f}"]
        for r in raw["rounds"]
    ]


def plain_notes(raw: dict) -> list[str]:
    """The plain decode step of each size, against its roofline on the bandwidth measured in the run."""
    gbs = raw["bandwidth_bytes_per_s"] / 1e9
    notes = [
        f"Plain decode step, batch {p['batch']}, {p['prompt_len']} prompt tokens: {p['step_ms']:.2f} ms; it must read "
        f"{p['step_bytes'] / 2**20:.0f} MiB (weights and KV cache), {p['roofline_ms']:.2f} ms at the {gbs:.1f} GB/s a "
        f"matrix-vector product reached in the same run: measured / roofline {p['measured_over_roofline']:.2f}; "
        f"compiled in {p['step_compile_s']:.1f} s."
        for p in raw["plain"]
    ]
    notes += [f"Refused: batch {r['batch']}, prompt {r['prompt_len']}: {r['error']}" for r in raw.get("refused", [])]
    return notes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.cost_results", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("raw", help="the JSON `python -m infer cost --json` wrote")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", required=True)
    ap.add_argument("--order", type=int, required=True)
    ap.add_argument("--setup", required=True)
    ap.add_argument("--hardware", required=True)
    ap.add_argument("--command", help="the command as shown (default: the one the raw file recorded)")
    ap.add_argument("--note", action="append", default=[], help="a note after the computed ones (repeatable)")
    ap.add_argument("--design", help="the design note behind it (docs/design/...)")
    args = ap.parse_args(argv)
    raw = json.loads(Path(args.raw).read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    result = {
        "title": args.title,
        "order": args.order,
        "setup": args.setup,
        "command": args.command or raw["command"],
        "hardware": args.hardware,
        "jax": raw["jax"],
        "commit": commit.stdout.strip(),
        "date": datetime.date.today().isoformat(),
        "columns": COLUMNS,
        "rows": rows(raw),
        "notes": plain_notes(raw) + args.note,
    }
    if args.design:
        result["design"] = args.design
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
