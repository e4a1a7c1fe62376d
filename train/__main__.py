"""`python -m train`: train a P-EAGLE (or EAGLE-3, or DFlash) drafter head, export it for vLLM, measure it.

No arguments = the default run (Gemma-3-270M, ShareGPT). `--preset tiny` = a random tiny target
and synthetic data, end to end in seconds. `--help` lists every field. Errors are one line and a
non-zero exit (`peagle_jax.runtime.command_line.run`: 2 a bad flag, 1 a failed run, 130 interrupted).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

RESUME_HINT = "interrupted: rerun with the same --out to resume from the last checkpoint"
STARTING = "interrupted while starting: nothing was written"  # before the run makes or opens --out


def main(argv=None, hooks: Sequence = ()) -> int:
    """The command line; `hooks` (`train.trainer.Hook`) are handed to the trainer's loop."""
    from peagle_jax.runtime.command_line import exit_interrupted, run, terminate_as_interrupt

    terminate_as_interrupt(STARTING)  # first: an interrupt while the rest imports ends the process at once
    try:
        from peagle_jax.runtime.host import reuse_freed_memory

        reuse_freed_memory()  # before JAX starts its threads (peagle_jax.runtime.host)
        from train.flags import parse_args

        return run(argv, parse_args, lambda cfg: train(cfg, hooks), interrupted=RESUME_HINT, starting=STARTING)
    except KeyboardInterrupt:  # landed before run's own frame
        exit_interrupted(RESUME_HINT)


def train(cfg, hooks: Sequence = ()) -> int:
    from peagle_jax.runtime.compile_cache import enable_compile_cache
    from train.loop import run

    enable_compile_cache()  # before the first compile

    summary = run(cfg, hooks)
    if summary is None:  # a process other than 0 of a multi-host run: process 0 reports
        return 0
    if summary.get("prepared_only"):
        print(f"data prepared: {summary['out']}/summary.json (data.prepare_only: no head trained)")
        return 0
    check_losses(summary)
    if summary.get("target_load_format") == "dummy":
        print("note: the target's weights were dummy (random): the figures below measure speed, not learning")
    print(f"head: {summary['head_dir']}")
    print(f"vllm: {summary['vllm_dir']}")
    acc = ", ".join(f"{a:.2f}" for a in summary["per_depth_accuracy"])
    loss = summary["final_loss"]
    print(
        f"trained {summary['steps']} steps, {summary['train_tokens']} tokens, in {summary['wall_seconds']:.0f} s: "
        f"final loss {loss if loss is None else round(loss, 4)}, per-depth accuracy [{acc}], "
        f"simulated acceptance length {training_tau(summary)}" + heldout_tau(summary)
    )
    ev = summary.get("eval")
    if ev:
        print(
            f"{ev['prompt_set']} ({ev['prompts']} prompts, greedy, K={ev['k']}): acceptance length "
            f"{ev['acceptance_length']:.2f}, {ev['tokens_per_second']:.1f} tok/s vs "
            f"{ev['baseline_tokens_per_second']:.1f} plain = {ev['speedup']:.2f}x"
        )
    print_advice(summary)
    if summary.get("target_load_format") == "dummy":  # nothing worth serving: its drafts mean nothing
        print("serve: none (a head trained on dummy weights is for speed and memory runs)")
        return 0
    if summary.get("serve_note"):
        print(f"note: {summary['serve_note']}")
    for line in summary["serve_lines"]:
        print(f"serve: {line}")
    return 0


def training_tau(summary: dict) -> str:
    """The last training batches' simulated acceptance, with its standard error over those
    batches when the run has one: a few conversations the head drafts almost whole (a repeated
    text) move a mean over 20 batches by tenths."""
    tau, se, n = (
        summary.get(k)
        for k in ("simulated_acceptance_length", "simulated_acceptance_se", "simulated_acceptance_batches")
    )
    if tau is None:
        return "None on the last training batches"
    return (
        f"{tau:.2f} ± {se:.2f} on the last {n} training batches"
        if se is not None
        else f"{tau:.2f} on the last training batches"
    )


def heldout_tau(summary: dict) -> str:
    """The held-out acceptance beside the training batches' one: batches the head has learned
    from overstate what it accepts on new text (regenerated data most of all), and a mean over
    every anchor overstates what greedy rounds accept (they step over long accepts): the per-round
    figure is the engine's acceptance length answering the held-out conversations."""
    held, n = summary.get("heldout") or {}, summary.get("data", {}).get("heldout")
    rounds = summary.get("heldout_rounds")
    if rounds and rounds["rounds"]:
        return (
            f", {rounds['per_anchor']:.2f} per anchor and {rounds['per_round']:.2f} ± {rounds['per_round_se']:.2f} "
            f"per greedy round (K={rounds['k']}, {rounds['rounds']} rounds: what the engine accepts) on the "
            f"{rounds['conversations']} held-out conversations"
        )
    tau = held.get("eval_sim_tau")
    return "" if tau is None else f", {tau:.2f} on the {n} held-out conversations"


def print_advice(summary: dict) -> None:
    """The fastest measured K and what this run's curve says about paying off (`train.payoff`)."""
    if "best_k" not in summary:
        return
    by_k, best = summary["eval"]["by_k"], summary["best_k"]
    speeds = ", ".join(f"K={k}: {v['acceptance_length']:.2f} accepted, {v['speedup']:.2f}x" for k, v in by_k.items())
    print(f"per K: {speeds}; fastest K={best}")
    pay, speedup = summary["payoff"][best], by_k[best]["speedup"]
    need, tokens = pay["break_even_acceptance"], pay["tokens_needed"]
    line = f"a head pays off at K={best} from acceptance {need:.2f} (this machine's round cost): "
    if need < 1.0:  # acceptance / speedup is a round's cost in plain steps: below one, the clock was disturbed
        line += "a round timed cheaper than a plain step, so the timings are unreliable (a busy machine?)"
    elif speedup >= 1.0:
        line += f"this one does ({speedup:.2f}x plain decoding)"
    elif tokens is None:
        line += "this run's learning curve does not rise enough to say when"
    else:
        line += f"this run's curve reaches it at ~{tokens:.2g} training tokens (extrapolated from {pay['tokens_seen']})"
    print(line)
    if summary.get("accelerator_command"):
        print(f"on an accelerator: {summary['accelerator_command']}")
    elif summary.get("accelerator_steps_beyond"):
        from train.checks import INT_MAX

        print(
            f"on an accelerator: no single run gets there (~{summary['accelerator_steps_beyond']:.2g} steps of 8 "
            f"sequences; --loop.steps takes at most {INT_MAX})"
        )


def check_losses(summary: dict) -> None:
    """A TrainError (exit 1) when the run's summary holds a loss that is not finite: a last guard
    behind `train.loop.StopOnNonFinite` (which checks every step's loss, gradient and updated
    parameters) for the held-out loss."""
    from train.loop import TrainError

    heldout = summary.get("heldout") or {}
    losses = {"first_loss": summary.get("first_loss"), "final_loss": summary.get("final_loss")}
    losses["held-out loss"] = heldout.get("eval_loss")
    for name, value in losses.items():
        if value is not None and not math.isfinite(value):
            raise TrainError(
                f"the run's {name} is {value} (not finite): its head in {summary['head_dir']} is not usable; "
                "lower optim.lr or the weight decay and train again in a new --out"
            )


if __name__ == "__main__":
    sys.exit(main())
