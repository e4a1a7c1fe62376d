"""`python -m train`: train a P-EAGLE (or EAGLE-3) drafter head, export it for vLLM, measure it.

No arguments = the default run (Gemma-3-270M, ShareGPT, ~15 minutes on a 2-core CPU).
`--preset tiny` = a random tiny target and synthetic data, end to end in seconds.
`--help` lists every field. Errors are one line and a non-zero exit.
"""

from __future__ import annotations

import os
import sys


def main(argv=None) -> int:
    from peagle_jax.host import reuse_freed_memory

    reuse_freed_memory()  # before JAX starts its threads (peagle_jax.host: ~15% of a CPU step)
    from train.config import ConfigError, parse_args

    try:
        cfg = parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from train.data import DataError
    from train.loop import TrainError, run

    try:
        summary = run(cfg)
    except (DataError, TrainError, ValueError, FileNotFoundError) as e:
        if os.environ.get("PEAGLE_TRACEBACK"):
            raise
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: rerun with the same --out to resume from the last checkpoint", file=sys.stderr)
        return 130
    if summary is None:  # a process other than 0 of a multi-host run: process 0 reports
        return 0
    if summary.get("prepared_only"):
        print(f"data prepared: {summary['out']}/summary.json (data.prepare_only: no head trained)")
        return 0
    print(f"head: {summary['head_dir']}")
    print(f"vllm: {summary['vllm_dir']}")
    acc = ", ".join(f"{a:.2f}" for a in summary["per_depth_accuracy"])
    loss, tau = summary["final_loss"], summary["simulated_acceptance_length"]
    print(
        f"trained {summary['steps']} steps, {summary['train_tokens']} tokens, in {summary['wall_seconds']:.0f} s: "
        f"final loss {loss if loss is None else round(loss, 4)}, per-depth accuracy [{acc}], "
        f"simulated acceptance length {tau if tau is None else round(tau, 2)}"
    )
    ev = summary.get("eval")
    if ev:
        print(
            f"{ev['prompt_set']} ({ev['prompts']} prompts, greedy, K={ev['k']}): acceptance length "
            f"{ev['acceptance_length']:.2f}, {ev['tokens_per_second']:.1f} tok/s vs "
            f"{ev['baseline_tokens_per_second']:.1f} "
            f"plain = {ev['speedup']:.2f}x"
        )
    print(f"serve: {summary['serve']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
