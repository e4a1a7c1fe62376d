"""Acceptance length against training tokens, from the trainer's own logs.

Reads OUT/metrics.jsonl (and OUT/summary.json) of one or more `python -m train` runs and plots the
simulated acceptance length (1 + the sum of per-depth conditional accuracies up to K = 7, the
quantity the engine's acceptance follows) of the training batches (means over windows of steps)
and of the held-out evaluations, against the tokens seen; the measured MT-Bench acceptance of the
finished head is one marked point. A straight line through depth-0 accuracy against log10(tokens)
(the shape of these early curves) says roughly what budget a target accuracy needs: an
extrapolation, printed as such.

    python -m bench.learning_curve RUN [RUN ...] --png docs/training_curve.png --json docs/training_curve.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np


def read_run(out: Path, window: int) -> dict:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in recs if "loss" in r and "acc" in r]
    tokens = np.cumsum([r["tokens"] for r in train])
    windows = []
    for lo in range(0, len(train), window):
        part = train[lo : lo + window]
        windows.append(
            {
                "step": part[-1]["step"],
                "tokens": int(tokens[lo + len(part) - 1]),
                "sim_tau": float(np.mean([r["sim_tau"] for r in part])),
                "acc": [float(x) for x in np.mean([r["acc"] for r in part], axis=0)],
            }
        )
    by_step = dict(zip((r["step"] for r in train), tokens))
    heldout = [
        {"step": r["step"], "tokens": int(by_step.get(r["step"], 0)), "sim_tau": r["eval_sim_tau"]}
        for r in recs
        if "eval_sim_tau" in r and r["step"] in by_step
    ]
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    ev = summary.get("eval") or {}  # the trainer's summary: {"by_k": {"7": {...}}, ...} (older runs: one K)
    by_k = ev.get("by_k") or ({str(ev["k"]): ev} if "k" in ev else {})
    measured = [{"k": int(k), **{f: v[f] for f in ("acceptance_length", "speedup") if f in v}} for k, v in by_k.items()]
    return {"run": str(out), "windows": windows, "heldout": heldout, "eval": measured}


def fit_log_tokens(runs: list[dict], depth: int = 0) -> tuple[float, float]:
    """Least squares acc_depth = a + b * log10(tokens) over every window after the first."""
    xs, ys = [], []
    for run in runs:
        for w in run["windows"][1:]:
            xs.append(math.log10(w["tokens"]))
            ys.append(w["acc"][depth])
    b, a = np.polyfit(xs, ys, 1)
    return float(a), float(b)


def tokens_for(acc: float, a: float, b: float) -> float | None:
    return 10 ** ((acc - a) / b) if b > 0 else None


def plot(runs: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in runs:
        name = Path(run["run"]).name
        w = run["windows"]
        ax.plot([x["tokens"] for x in w], [x["sim_tau"] for x in w], label=f"{name}: training batches (simulated)")
        if run["heldout"]:
            h = run["heldout"]
            ax.plot([x["tokens"] for x in h], [x["sim_tau"] for x in h], "o--", label=f"{name}: held out (simulated)")
        for e in run["eval"] or []:
            if e.get("k") == 7 and w:
                ax.plot([w[-1]["tokens"]], [e["acceptance_length"]], "k*", markersize=12)
                ax.annotate(f"MT-Bench K=7: {e['acceptance_length']:.2f}", (w[-1]["tokens"], e["acceptance_length"]))
    ax.set_xscale("log")
    ax.set_xlabel("training tokens seen")
    ax.set_ylabel("acceptance length (K = 7)")
    ax.axhline(2.0, color="gray", linestyle=":", label="goal 2.0")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.learning_curve", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="OUT folders of python -m train")
    p.add_argument("--window", type=int, default=40, help="training steps averaged per point")
    p.add_argument("--png", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    for out in args.runs:
        if not (out / "metrics.jsonl").is_file():
            p.error(f"{out}: no metrics.jsonl (not a python -m train output folder)")
    runs = [read_run(out, args.window) for out in args.runs]
    a, b = fit_log_tokens(runs)
    need = {str(t): tokens_for(t, a, b) for t in (0.3, 0.5, 0.6)}
    for run in runs:
        print(run["run"])
        print(f"  {'step':>5} {'tokens':>8} {'sim tau':>8} {'acc0':>6} {'acc1':>6}")
        for w in run["windows"]:
            print(f"  {w['step']:>5} {w['tokens']:>8} {w['sim_tau']:>8.3f} {w['acc'][0]:>6.3f} {w['acc'][1]:>6.3f}")
        for h in run["heldout"]:
            print(f"  held out at step {h['step']} ({h['tokens']} tokens): simulated tau {h['sim_tau']:.3f}")
        for e in run["eval"] or []:
            print(f"  measured: K={e['k']} acceptance {e['acceptance_length']:.3f}, speedup {e.get('speedup', 0):.2f}x")
    print(f"fit: depth-0 accuracy = {a:.3f} + {b:.3f} * log10(tokens)  (an extrapolation)")
    for acc, t in need.items():
        print(f"  depth-0 accuracy {acc}: ~{t:.3g} tokens" if t else f"  depth-0 accuracy {acc}: not reached")
    if args.png:
        plot(runs, args.png)
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "fit": {"a": a, "b": b, "tokens_for_acc0": need}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
