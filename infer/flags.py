"""The flags that name what a command runs (target, head, K, mode, weights, dtype) and the devices
it runs on (the mesh), one definition for `generate`, `bench`, `cost` and `serve`; and the list
types the commands share."""

from __future__ import annotations

import argparse

from peagle_jax.cli import positive_int

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
        help="auto: every local device, tensor-parallel (--tensor = the devices / --data)",
    )
