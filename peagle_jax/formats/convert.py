"""`python -m peagle_jax.convert` (console script `peagle-convert`): drafter and target checkpoints
between this project and the formats vLLM serves (docs/method.md section 6). The CLI only: its
operations are `peagle_jax.formats.conversion`, the formats `peagle_jax.formats.checkpoints` /
`peagle_jax.formats.head_config`, the lint `peagle_jax.formats.inspect`.

```
peagle-convert export CKPT OUT --format vllm|speculators [--dtype bfloat16|float32] [--as eagle3]
               [--max-shard-size 5GB] [--target DIR] [--verifier ORG/NAME] [--overwrite] [--force]
peagle-convert import SRC OUT [--dtype float32|bfloat16] [--target DIR] [--overwrite] [--force]
peagle-convert inspect DIR [--target DIR] [--vllm-version X.Y] [--json]
peagle-convert export-target SRC_HF OUT [--dtype auto|float32|bfloat16] [--max-shard-size 5GB] [--overwrite]
peagle-convert import-target SRC_HF OUT [--dtype auto|float32|bfloat16] [--max-shard-size 5GB] [--overwrite]
```
- `export`: a drafter (our checkpoint, or any folder `load_drafter` reads) -> `config.json` +
  `model.safetensors` (vLLM native: `midlayer.*`, the mask id under all of `mask_token_id`,
  `pard_token`, `ptd_token_id`; speculators: `speculators_model_type` peagle / eagle3, no top-level
  `model_type`, `layers.0.*`). Above `--max-shard-size` the tensors go to
  `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`. The folder is written to a
  temporary sibling and renamed at the end; it is inspected there first and refused (nothing
  written) when `inspect` would report a problem, unless `--force`. With `--target`, a
  `max_position_embeddings` below the target's is raised to it. Prints how to serve it
  (`peagle_jax.formats.serving.serve_lines`: the vLLM command, K = the trained depth capped at 7,
  P-EAGLE's best served K, pinned to vLLM 0.16-0.33 for a P-EAGLE head; this project's engine).
  `--as eagle3` writes a P-EAGLE head as a plain EAGLE-3 head (no mask_hidden, no mask id), the
  form vLLM 0.34 and later serve; it drafts one token at a time there, which it was not trained for.
- `import`: a vLLM-native or speculators folder (EAGLE-3, P-EAGLE or DFlash) -> our checkpoint
  (`drafter.json` + `state/`); a DFlash head saved without embed_tokens / lm_head (speculators)
  takes them from `--target DIR`. Held to the bar of export: the checkpoint is inspected in its
  temporary folder (against `--target`, else the recorded verifier when it is here) and refused,
  nothing written, when `inspect OUT` would report a problem (NaN / Inf weights, aux ids outside the
  target's layers), unless `--force` (each problem then a `warning:` line). DFlash exports: `DFlashDraftModel` with `dflash_config`
  (vLLM native, z-lab ids = ours - 1) or speculators "dflash"; served with `"method": "dflash"`,
  K = block_size - 1. `inspect`: the lint (`peagle_jax.formats.inspect`); exit 1 on a problem,
  among them a head the vLLM release of `--vllm-version` refuses (default: the vLLM installed
  beside this project, else the newest release `engines` knows).
- `export-target` / `import-target`: a target model's Hugging Face folder, loaded and validated
  (every tensor consumed, every shape checked) and written back by this project
  (`weights.target_tensors` + `registry.hf_config`, tokenizer files copied): the HF round trip.

Exit status: 0 ok, 1 a problem with the input or output (one line `error: ...` on stderr naming
the file and key), 2 a usage error, among them an OUT checked before any work: the input folder
itself (or one holding it), a file, below a file, or in a folder that cannot be written. Normal
output goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from peagle_jax.runtime.command_line import DefaultsFormatter, OneLineParser, UsageError, run, terminate_as_interrupt

if __name__ == "__main__":  # `python -m peagle_jax.formats.convert`: the imports below load JAX (seconds)
    terminate_as_interrupt("interrupted")

from peagle_jax.formats.conversion import AS_KINDS, FORMATS, convert_target, export_drafter, import_drafter_folder
from peagle_jax.formats.engines import NEWEST_VLLM, installed_vllm, parse_vllm_version
from peagle_jax.formats.inspect import format_report, inspect_folder
from peagle_jax.formats.serving import SERVE_K
from peagle_jax.runtime.folders import (
    DEFAULT_MAX_SHARD,
    INDEX_FILE,
    parse_size,
)
from peagle_jax.sources.hub import is_repo_id, resolve

__all__ = [
    "main",
    "build_parser",
    "parse_size",
    "INDEX_FILE",
    "FORMATS",
]


# ---------------------------------------------------------------------------------------
# command line
def _size_arg(text: str) -> str:
    try:
        parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _target_arg(text: str) -> str:
    """--target: an existing folder, or a Hub id (org/name) where no such path exists."""
    p = Path(text)
    if p.is_dir() or (not p.exists() and is_repo_id(text)):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r}: " + ("not a folder" if p.exists() else "no such folder, nor a Hub id (org/name)")
    )


def _hub_id_arg(text: str) -> str:
    if not is_repo_id(text):
        raise argparse.ArgumentTypeError(f"expected a Hub id (org/name), got {text!r}")
    return text


def _version_arg(text: str) -> tuple[int, int]:
    try:
        return parse_vllm_version(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def vllm_to_check(flag: tuple[int, int] | None) -> tuple[tuple[int, int], str]:
    """(the vLLM release `inspect` checks serving with, where it came from)."""
    if flag is not None:
        return flag, "--vllm-version"
    installed = installed_vllm()
    return (installed, "installed") if installed is not None else (NEWEST_VLLM, "the newest release known")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="peagle-convert",
        description="Drafter and target checkpoints <-> vLLM / speculators formats (python -m peagle_jax.convert).",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser, metavar="COMMAND")

    for add in (_add_export, _add_import, _add_inspect, _add_target_commands):
        add(sub)
    return parser


def _add_export(sub) -> None:
    """`export`: a head -> a vLLM-native or speculators folder."""
    p = sub.add_parser(
        "export",
        formatter_class=DefaultsFormatter,
        help="our drafter checkpoint -> vLLM-native or speculators folder",
        description="Our drafter checkpoint (or any folder load_drafter reads) -> config.json + "
        "model.safetensors in the vLLM-native EAGLE-3 layout (serve with parallel_drafting: true) "
        "or the speculators layout. Written atomically; refused when inspect finds a problem. Prints how to "
        f"serve it: the vLLM command (num_speculative_tokens = the trained depth capped at {SERVE_K}, P-EAGLE's "
        "best served K; a P-EAGLE head pinned to vLLM 0.16-0.33, the releases that serve it) and this project's "
        "engine.",
    )
    p.add_argument("ckpt", metavar="CKPT", help="drafter checkpoint folder, or a Hub id (org/name)")
    p.add_argument("out", metavar="OUT", help="output folder")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="float tensors' dtype (d2t stays int64, t2d bool)",
    )
    p.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD,
        type=_size_arg,
        help="shard above this size (e.g. 500MB, 2GiB, bytes)",
    )
    p.add_argument(
        "--target",
        metavar="DIR",
        type=_target_arg,
        help="the target's HF folder or Hub id: checked against, and its "
        "max_position_embeddings used when larger than the drafter's",
    )
    p.add_argument(
        "--verifier",
        metavar="ORG/NAME",
        type=_hub_id_arg,
        help="the target's hub id to record (speculators "
        "verifier.name_or_path, which `vllm serve OUT` needs; default: --target's id when it came from the Hub, "
        "else the one the drafter recorded)",
    )
    p.add_argument(
        "--as",
        dest="as_kind",
        choices=AS_KINDS,
        help="eagle3: write a P-EAGLE head as plain EAGLE-3 (no mask_hidden, no mask id), the form vLLM 0.34 and "
        "later serve; it then drafts one token at a time, which it was not trained for",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT folder")
    p.add_argument("--force", action="store_true", help="write even when inspect reports problems")


def _add_import(sub) -> None:
    """`import`: a vLLM-native / speculators folder -> our checkpoint."""
    p = sub.add_parser(
        "import",
        formatter_class=DefaultsFormatter,
        help="vLLM-native / speculators folder -> our drafter checkpoint",
        description="A vLLM-native EAGLE-3 / P-EAGLE folder (midlayer.* or layers.0.*, with or "
        "without attention bias, draft vocab with d2t), a DFlash folder (DFlashDraftModel) or a speculators "
        "peagle / eagle3 / dflash folder -> "
        "our checkpoint (drafter.json + state/), loaded by peagle_jax.load_drafter.",
    )
    p.add_argument("src", metavar="SRC", help="source folder, or a Hub id (org/name)")
    p.add_argument("out", metavar="OUT", help="output checkpoint folder")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="parameter dtype of our checkpoint (float32 is exact for bf16 sources)",
    )
    p.add_argument(
        "--target",
        metavar="DIR",
        type=_target_arg,
        help="target HF folder or Hub id: embeddings for an EAGLE-3 head that ships none (DFlash: embeddings and "
        "lm_head)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT checkpoint")
    p.add_argument("--force", action="store_true", help="import even when inspect reports problems")


def _add_inspect(sub) -> None:
    """`inspect`: the lint of a head folder."""
    p = sub.add_parser(
        "inspect",
        formatter_class=DefaultsFormatter,
        help="describe a drafter folder and list what would break vLLM",
        description="What a drafter folder is (format, mode, layers, vocab sizes, mask id, aux ids, "
        "K hints) and every problem that would stop vLLM or silently degrade it, for one vLLM release "
        "(--vllm-version: vLLM 0.34 refuses P-EAGLE heads). Exit 0 when clean, 1 when there are problems, 2 "
        "when the folder cannot be inspected.",
    )
    p.add_argument("dir", metavar="DIR", help="drafter folder (vLLM, speculators or ours), or a Hub id")
    p.add_argument(
        "--target",
        metavar="DIR",
        type=_target_arg,
        help="target HF folder or Hub id to check against (default: the recorded verifier, when it is here "
        "or in the Hugging Face cache)",
    )
    p.add_argument(
        "--vllm-version",
        metavar="X.Y",
        type=_version_arg,
        help="the vLLM release to check serving with (exit 1 when it cannot serve the head as trained; default: "
        f"the vLLM installed here, else {NEWEST_VLLM[0]}.{NEWEST_VLLM[1]}, the newest release this lint knows)",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _add_target_commands(sub) -> None:
    """`export-target` / `import-target`: a target's round trip."""
    round_trip = (
        " Both target commands run the same round trip: the folder is loaded as load_target does "
        "(every tensor consumed, every shape checked), then written back by this project "
        "(weights.target_tensors + registry.hf_config; tokenizer files copied; atomic). The two names "
        "mirror import / export of heads: import-target brings a folder in, normalised; export-target "
        "hands one out in the plain Hugging Face layout transformers and vLLM load."
    )
    for name, text in (
        ("export-target", "a target's HF folder -> the plain HF layout, written by this project"),
        ("import-target", "a target's HF folder -> validated and normalised by this project"),
    ):
        p = sub.add_parser(name, help=text, description=text + "." + round_trip, formatter_class=DefaultsFormatter)
        p.add_argument("src", metavar="SRC_HF", help="Hugging Face model folder, or a Hub id (org/name)")
        p.add_argument("out", metavar="OUT", help="output folder")
        p.add_argument(
            "--dtype",
            default="auto",
            choices=["auto", "float32", "bfloat16"],
            help="auto: bfloat16 sources stay bfloat16, others float32",
        )
        p.add_argument(
            "--max-shard-size",
            default=DEFAULT_MAX_SHARD,
            type=_size_arg,
            help="shard above this size",
        )
        p.add_argument("--overwrite", action="store_true", help="replace an existing OUT folder")


def _run(args) -> int:
    out = sys.stdout
    if args.command == "export":
        folder, report = export_drafter(
            args.ckpt,
            args.out,
            args.format,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            target=args.target,
            verifier=args.verifier,
            overwrite=args.overwrite,
            force=args.force,
            as_kind=args.as_kind,
        )
        print(f"wrote {folder} ({args.format}, {args.dtype}, {len(report['files'])} file(s))", file=out)
        for n in report.get("notes", []) + ([report["serve_note"]] if report.get("serve_note") else []):
            print(f"note: {n}", file=out)
        for w in report.get("warnings", []):
            print(f"warning: {w}", file=sys.stderr)
        for p in report.get("problems", []):
            print(f"warning: (forced) {p}", file=sys.stderr)
        for line in report["serve_lines"]:
            print(f"serve: {line}", file=out)
        return 0
    if args.command == "import":
        c, report = import_drafter_folder(
            args.src, args.out, dtype=args.dtype, target=args.target, overwrite=args.overwrite, force=args.force
        )
        print(
            f"wrote {Path(args.out).absolute()}: {c.mode} head, {c.num_layers} layer(s), hidden {c.hidden_size}, "
            f"vocab {c.vocab_size} (draft {c.draft_vocab_size}), {args.dtype}",
            file=out,
        )
        for n in report.get("notes", []):
            print(f"note: {n}", file=out)
        for p in report.get("problems", []):
            print(f"warning: (forced) {p}", file=sys.stderr)
        return 0
    if args.command == "inspect":
        target = None if args.target is None else resolve(args.target, "target")
        version, source = vllm_to_check(args.vllm_version)
        report = inspect_folder(resolve(args.dir, "head"), target=target, vllm_version=version)
        report["vllm_version_source"] = source
        print(json.dumps(report, indent=2) if args.json else format_report(report), file=out)
        return 1 if report["problems"] else 0
    if args.command in ("export-target", "import-target"):
        folder = convert_target(
            args.src, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size, overwrite=args.overwrite
        )
        print(f"wrote {folder}", file=out)
        return 0
    raise UsageError(f"unknown command {args.command!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI. Exit status: 0 ok, 1 the work failed, 2 usage, 130 interrupted; `inspect`: 0
    clean, 1 problems found, 2 the folder could not be inspected."""
    return run(  # reads until an export or import writes its temporary folder
        argv,
        build_parser().parse_args,
        _run,
        failure_code=lambda args: 2 if args.command == "inspect" else 1,
        starting="interrupted",
    )


if __name__ == "__main__":
    sys.exit(main())
