"""`python -m peagle_jax.plan --target T --device D --job train|serve [--json FILE]`

Compiles, for device D (h100, h200, h100x8, h200x8x2, v5e-8, v5p-8, v6e-8, v5e-256, ...) and no
device present, the programs a user runs on target T (an HF folder, a folder with only
config.json, or a preset: see --list) with abstract weights: the train step of each head mode
(P-EAGLE "parallel", EAGLE-3 "chain", DFlash "dflash"), or the speculative round of each mode
and the plain decode step ("none"). Prints one line per program: compiled or the compiler's
refusal, bytes per device (arguments / temporaries / outputs) against the device's memory, the
Pallas kernels in it, its kernel launches, the compile time. `--run` (on the device itself) runs
each program on dummy weights and prints its step time and peak memory beside the plan's. `--search` doubles the sequence length (train) or the
batch (serve) until a program is refused or does not fit, and reports the largest that did."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from infer.flags import add_mesh_flags
from peagle_jax.runtime.command_line import OneLineParser, positive_int, run
from peagle_jax.runtime.folders import atomic_write_text, unwritable

# peagle_jax.hardware.devices and peagle_jax.models.presets load JAX (seconds): imported where used, once `run` has
# installed the interrupt handlers


def parser() -> OneLineParser:
    p = OneLineParser(prog="python -m peagle_jax.plan", description=__doc__.split("\n\n")[1])
    p.add_argument("--target", help="an HF folder, a folder with config.json, or a preset name")
    p.add_argument("--device", help="h100, h200, h100x8, h200x8x2, v5e-8, v5p-8, v6e-8, v5e-256, ...")
    p.add_argument(
        "--job",
        choices=("train", "serve", "server"),
        default="train",
        help="train steps; serve: a round and the decode step at --batch; server: what `python -m infer serve` "
        "runs (its prefill calls of at most --tokens prompt tokens, as --prefill-chunk, and a step over --batch slots)",
    )
    p.add_argument("--modes", default=None, help="comma-separated modes (default: all of the job's)")
    p.add_argument(
        "--tokens",
        type=positive_int,
        default=4096,
        help="train: tokens per sequence; server: the prefill call's prompt tokens (serve's --prefill-chunk)",
    )
    p.add_argument(
        "--batch", type=positive_int, default=None, help="sequences per step (train: devices) or rows (serve: 1)"
    )
    p.add_argument("--k", type=positive_int, default=7, help="serve: drafts per round")
    p.add_argument("--cache-len", type=positive_int, default=8192, help="serve: KV cache slots per row")
    p.add_argument("--layers", type=int, default=None, help="the target's layers (fewer: a faster compile)")
    p.add_argument("--headroom", type=float, default=0.9, help="share of device memory a program may plan for")
    p.add_argument(
        "--train-flag", action="append", default=[], help="a `python -m train` flag, e.g. --model.num_layers=2"
    )
    p.add_argument("--search", action="store_true", help="the largest tokens (train) / batch (serve) that fits")
    p.add_argument(
        "--run",
        action="store_true",
        help="on the device itself: compile for this machine's devices and run each program on dummy weights, "
        "its step time and peak memory beside the plan's",
    )
    p.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    add_mesh_flags(p)  # serving plans: the mesh `python -m infer serve` runs on with the same flags
    p.add_argument("--list", action="store_true", help="list the preset targets and exit")
    return p


def parse(argv):
    args = parser().parse_args(argv)
    if args.list:
        return args
    from peagle_jax.hardware.devices import parse_device
    from peagle_jax.models.presets import PRESETS

    if not (args.target and args.device):
        parser().error("--target and --device are required")
    try:
        args.device = parse_device(args.device)
    except ValueError as err:
        parser().error(f"--device: {err}")
    if not (args.target.lower() in {k.lower() for k in PRESETS} or Path(args.target).exists()):
        parser().error(f"--target {args.target!r}: neither a folder nor a preset ({', '.join(PRESETS)})")
    if not 0 < args.headroom <= 1:
        parser().error(f"--headroom {args.headroom}: a share of the device's memory, in (0, 1]")
    if args.layers is not None and args.layers < 3:  # EAGLE-3 features: 3 distinct target layers
        parser().error(f"--layers {args.layers}: at least 3 (the heads read 3 distinct target layers)")
    if args.layers is not None:
        _check_layers(args)
    _check_work_flags(args)
    _check_mesh_flags(args)
    return args


def _check_layers(args) -> None:
    """More --layers than the target has is a usage error naming both (a target folder that cannot
    be read is the work's error, naming the folder)."""
    from peagle_jax.models.presets import target_config

    try:
        have = target_config(args.target, None).num_layers
    except (ValueError, OSError):
        return
    if args.layers > have:
        parser().error(f"--layers {args.layers}: the target {args.target} has {have} layers (a plan takes 3 .. {have})")


def _check_mesh_flags(args) -> None:
    """--tensor / --data / --devices auto (every device of --device) on a serving plan, checked as
    `python -m infer serve` checks them: the devices there, the rows (--batch) that --data divides,
    the target split by --tensor (`sharding.tensor_problem`). Resolved into `args.tensor`."""
    from infer.load import mesh_flags
    from peagle_jax.models.presets import target_config
    from peagle_jax.runtime.sharding import tensor_problem

    if args.tensor is None and args.devices is None and args.data == 1:
        return
    flags, count = mesh_flags(args), args.device.count
    if args.job == "train":
        parser().error(f"{flags}: a serving plan's mesh (--job serve or server); a train plan splits over fsdp")
    if args.devices and count % args.data:
        parser().error(f"{flags}: --data {args.data} does not divide the {count} devices of {args.device.name}")
    args.tensor = count // args.data if args.devices else args.tensor or 1
    if args.tensor * args.data > count:
        parser().error(f"{flags}: needs {args.tensor * args.data} devices, {args.device.name} has {count}")
    if args.batch and args.batch % args.data:
        parser().error(f"--batch {args.batch}: not divisible by --data {args.data}")
    why = tensor_problem(target_config(args.target, args.layers), args.tensor)
    if why:
        parser().error(f"{flags}: {why}")


def _check_work_flags(args) -> None:
    """What no program can use is a usage error before any compile: an unknown mode, train flags
    the trainer refuses (or given to a serving plan), a --json that cannot be written."""
    from plan.run import MODES

    modes = args.modes.split(",") if args.modes is not None else list(MODES[args.job])
    bad = [m for m in modes if m not in MODES[args.job]]
    if bad or len(set(modes)) != len(modes):
        what = f"unknown mode(s) {bad}" if bad else "a mode given twice"
        parser().error(f"--modes {args.modes!r}: {what} (--job {args.job}: {', '.join(MODES[args.job])})")
    if args.train_flag and args.job != "train":
        parser().error(f"--train-flag {args.train_flag[0]!r}: only a --job train plan builds the trainer's step")
    if args.train_flag:
        from plan.programs import train_flags_error

        for mode in modes:
            why = train_flags_error(mode, args.tokens, args.train_flag)
            if why:
                parser().error(f"--train-flag {' '.join(args.train_flag)!r}: {why}")
    why = args.json is not None and unwritable(args.json, "file")
    if why:
        parser().error(f"--json {args.json}: {why}")


def work(args) -> int:
    from peagle_jax.hardware.devices import deviceless_env
    from peagle_jax.models.presets import PRESETS, target_config

    if args.list:
        print("\n".join(PRESETS))
        return 0
    if not args.run:
        deviceless_env()
    from plan.run import plan, planned_ok

    result = plan(args, args.device, target_config(args.target, args.layers))
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=1) + "\n")
    return 0 if planned_ok(result) else 1


def main(argv=None) -> int:
    return run(argv, parse, work, starting="interrupted")  # compiles only, until --json is written


if __name__ == "__main__":
    sys.exit(main())
