"""The flags that name what a command runs (target, head, K, mode, weights, dtype) and the devices
it runs on (the mesh; serve's hosts: `--dist.*`), one definition for `generate`, `bench`, `cost`
and `serve`; and the list types the commands share."""

from __future__ import annotations

import argparse
import dataclasses

from peagle_jax.runtime.command_line import number_type, positive_int

MODES = ("parallel", "chain", "dflash")


def k_list(text: str) -> list[int]:
    """An argparse type: "7" or "1,3,5,7" (distinct positive integers, kept in order)."""
    ks = [positive_int(t) for t in text.replace(" ", "").split(",") if t]
    if not ks or len(set(ks)) != len(ks):
        raise argparse.ArgumentTypeError(f"expected positive integers, comma separated, each once, got {text!r}")
    return ks


def mode_list(text: str) -> list[str]:
    """An argparse type: drafting modes, comma separated, each once."""
    modes = [m for m in text.replace(" ", "").split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if not modes or bad or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(
            f"expected some of {', '.join(MODES)}, comma separated, each once, got {text!r}"
        )
    return modes


def add_model_flags(p: argparse.ArgumentParser, several: bool = False) -> None:
    """--target, --drafter, --k, --mode, --load-format, --dtype, --deep-k; `several`: --drafter
    repeatable and --k a list (bench)."""
    p.add_argument("--target", required=True, metavar="DIR", help="Hugging Face folder of the target, or its Hub id")
    head = "drafter checkpoint (ours, vLLM or speculators folder, or a Hub id), or new[:LAYERS] for a fresh random head"
    if several:
        more = "; repeat the flag to compare several heads in one run; needed unless --mode none"
        p.add_argument("--drafter", metavar="DIR", action="append", help=head + more)
        p.add_argument("--k", type=k_list, default=[7], help="drafts per round: one K, or several (1,3,5,7)")
    else:
        p.add_argument("--drafter", metavar="DIR", help=head + "; needed unless --mode none")
        p.add_argument("--k", type=positive_int, default=7, help="drafts per round")
    p.add_argument(
        "--mode",
        default=None,
        choices=[*MODES, "none"],
        help="parallel = P-EAGLE (one drafter pass), chain = EAGLE-3, dflash = DFlash, none = plain decoding "
        "(default: each head's own mode)",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="auto = read the target's weights; dummy = random weights of its shapes, nothing read (speed and memory "
        "runs, as vLLM's flag): --target may then also be a preset (Llama-3.1-8B, Qwen3-8B, ...) or a folder with "
        "only config.json",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="target dtype; auto = float32 on CPU, bfloat16 on GPU/TPU",
    )
    p.add_argument(
        "--deep-k", default="error", choices=["error", "warn"], help="k above the drafter's trained depth: fail or warn"
    )
    add_mesh_flags(p)


def add_mesh_flags(p: argparse.ArgumentParser) -> None:
    """--tensor, --data, --devices: the devices a command runs on (`infer.load.mesh_sizes` reads
    them, `infer.load.check_mesh` checks them against the target and the machine)."""
    devices = p.add_mutually_exclusive_group()
    devices.add_argument(
        "--tensor",
        type=positive_int,
        default=None,
        metavar="N",
        help="tensor-parallel over N devices: the weights split by the sharding rule table (attention heads, MLP "
        "width, vocabulary), each KV cache by KV heads (default 1)",
    )
    p.add_argument(
        "--data",
        type=positive_int,
        default=1,
        metavar="D",
        help="data-parallel over D groups of --tensor devices: the rows (decode slots, a batch's prompts) split "
        "over them, the weights replicated",
    )
    devices.add_argument(
        "--devices",
        choices=["auto"],
        default=None,
        help="auto: every device, tensor-parallel (--tensor = the devices / --data; across hosts: every process's)",
    )


BOOL_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
non_negative_int = number_type(int, 0, 1 << 20, "an integer >= 0")


def bool_word(text: str) -> bool:
    """An argparse type: true / false (yes / no, 1 / 0), as the trainer's flags take them."""
    if text.lower() not in BOOL_WORDS:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return BOOL_WORDS[text.lower()]


DIST_KINDS = {  # how each field of peagle_jax.runtime.distributed.DistConfig is typed on the command line
    "coordinator": dict(metavar="HOST:PORT"),
    "num_processes": dict(type=positive_int, metavar="N"),
    "process_id": dict(type=non_negative_int, metavar="I"),
    "auto": dict(type=bool_word, nargs="?", const=True, metavar="true|false"),
    "heartbeat_timeout": dict(type=positive_int, metavar="SECONDS"),
    "initialization_timeout": dict(type=positive_int, metavar="SECONDS"),
}


def add_dist_flags(p: argparse.ArgumentParser) -> None:
    """The trainer's `--dist.*` flags (their names, defaults and help: `peagle_jax.runtime.distributed`):
    one run over several processes, one a host (`--dist.process-id` spelt with a dash too)."""
    from peagle_jax.runtime.distributed import DistConfig, field_help

    group = p.add_argument_group("several hosts (one process each, JAX multi-controller)")
    for field in dataclasses.fields(DistConfig):
        names = dict.fromkeys([f"--dist.{field.name}", f"--dist.{field.name.replace('_', '-')}"])
        group.add_argument(*names, dest=f"dist_{field.name}", default=field.default, help=field_help()[field.name],
                           **DIST_KINDS[field.name])  # fmt: skip


def dist_config(args):
    """The `DistConfig` of the `--dist.*` flags."""
    from peagle_jax.runtime.distributed import DistConfig

    return DistConfig(**{f.name: getattr(args, f"dist_{f.name}") for f in dataclasses.fields(DistConfig)})
