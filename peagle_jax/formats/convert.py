"""`python -m peagle_jax.convert` (console script `peagle-convert`): drafter and target checkpoints
between this project and the formats vLLM serves (docs/method.md section 6). The CLI only:
the formats are `peagle_jax.formats.checkpoints` / `peagle_jax.formats.head_config`, the lint `peagle_jax.formats.inspect`.

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
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from peagle_jax.runtime.command_line import DefaultsFormatter, OneLineParser, UsageError, run, terminate_as_interrupt

if __name__ == "__main__":  # `python -m peagle_jax.formats.convert`: the imports below load JAX (seconds)
    terminate_as_interrupt("interrupted")

from peagle_jax.config.target_config import ConfigError
from peagle_jax.formats.checkpoints import read_drafter, speculators_tensors, vllm_tensors
from peagle_jax.formats.engines import NEWEST_VLLM, installed_vllm, parse_vllm_version
from peagle_jax.formats.head_config import refuse_head, run_folder_of
from peagle_jax.formats.head_config_write import speculators_config, vllm_config
from peagle_jax.formats.inspect import format_report, inspect_folder
from peagle_jax.formats.own import OWN_CONFIG_FILE, write_own
from peagle_jax.formats.serving import SERVE_K, resolve_verifier, target_facts
from peagle_jax.runtime.folders import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD,
    INDEX_FILE,
    check_destination,
    parse_size,
    unwritable,
    write_hf_folder,
)
from peagle_jax.sources.hub import is_repo_id, repo_id_of, resolve

__all__ = [
    "main",
    "build_parser",
    "export_drafter",
    "import_drafter_folder",
    "convert_target",
    "check_output",
    "DestinationError",
    "parse_size",
    "INDEX_FILE",
    "FORMATS",
]

FORMATS = ("vllm", "speculators")
AS_KINDS = ("eagle3",)  # export --as: a head written as another kind than it was trained as


class ConvertError(ValueError):
    """A problem with the input or the output (exit status 1)."""


class DestinationError(ConvertError, UsageError):
    """An output folder that cannot be written, or that would replace the input (exit status 2)."""


def check_output(src: str | os.PathLike, out: str | os.PathLike) -> Path:
    """`out` as an absolute path, checked before any work: neither the input folder nor one
    holding it (replacing it would destroy the input), not a file, and its nearest existing
    parent a writable folder (missing parents are created). DestinationError naming OUT."""
    dest, source = Path(out).absolute(), Path(src).resolve()
    if dest.resolve() == source:
        raise DestinationError(f"OUT {out}: is the input folder {src} (write the result to another folder)")
    if dest.resolve() in source.parents:
        raise DestinationError(f"OUT {out}: holds the input folder {src}; replacing it would delete the input")
    why = unwritable(dest, "folder")
    if why:
        raise DestinationError(f"OUT {out}: {why}")
    run = run_folder_of(dest)
    if run is not None:  # it holds config.json, which --overwrite would take for a model's
        raise DestinationError(f"OUT {out}: {run}; a converter never replaces a run's folder")
    return dest


# ---------------------------------------------------------------------------------------
# drafters
def _read_head(path: str | os.PathLike, target=None):
    """(config, arrays) of our checkpoint or any head folder `checkpoints.read_drafter` reads;
    `target` (a folder): where a head's missing target-shared tensors come from."""
    p = Path(path)
    if not p.exists():
        raise ConvertError(f"{p}: no such file or folder")
    if not p.is_dir():
        raise ConvertError(f"{p}: not a folder (a drafter checkpoint is a folder)")
    if not (p / OWN_CONFIG_FILE).exists() and not (p / CONFIG_FILE).exists():
        raise ConvertError(
            f"{p}: holds neither {OWN_CONFIG_FILE} (our checkpoint) nor {CONFIG_FILE} (a vLLM / speculators folder)"
        )
    usable = target is not None and Path(target).is_dir()  # a bad --target is reported by its check
    config, arrays, _ = read_drafter(p, **(_target_sources(Path(target)) if usable else {}))
    return config, arrays


def _export_target(target, recorded, ckpt: Path, notes: list[str]):
    """(target folder or None, its facts or None): `--target`, else the recorded verifier when
    it is on this machine (a broken one is skipped: the head is still exported)."""
    if target is not None:
        return target, target_facts(target)
    found = resolve_verifier(recorded, ckpt)
    if found is None:
        return None, None
    try:
        info = target_facts(found)
    except ConfigError:
        return None, None
    notes.append(f"checked against the recorded target {found}")
    return found, info


def export_drafter(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    fmt: str,
    *,
    dtype: str = "bfloat16",
    max_shard_size: int | str = DEFAULT_MAX_SHARD,
    target: str | os.PathLike | None = None,
    verifier: str | None = None,
    overwrite: bool = False,
    force: bool = False,
    as_kind: str | None = None,
) -> tuple[Path, dict]:
    """Our checkpoint (or any folder `read_drafter` reads) -> a vLLM / speculators folder.
    `verifier`: the target's hub id to record (speculators `verifier.name_or_path`); default: the
    id of a `target` that came from the Hub, else the one the head recorded. `ckpt` and `target`
    may be Hub ids (`peagle_jax.sources.hub`). `as_kind` "eagle3": a P-EAGLE head written as plain
    EAGLE-3 (`as_eagle3`).
    Returns (folder, its inspect report, whose `serve` is the vLLM command line and
    `serve_lines` what to run)."""
    if fmt not in FORMATS:
        raise ConvertError(f"unknown format {fmt!r} ({', '.join(FORMATS)})")
    if as_kind not in (None, *AS_KINDS):
        raise ConvertError(f"unknown --as {as_kind!r} ({', '.join(AS_KINDS)})")
    parse_size(max_shard_size)
    ckpt, target = resolve(ckpt, "head"), None if target is None else resolve(target, "target")
    verifier = verifier or repo_id_of(target)
    dest = check_output(ckpt, out)
    check_destination(dest, overwrite, CONFIG_FILE)
    cfg, arrays = _read_head(ckpt, target)
    warnings = [] if as_kind is None else [as_eagle3_warning(cfg, ckpt)]
    cfg = cfg if as_kind is None else as_eagle3(cfg)
    notes: list[str] = []
    target, cfg = _fit_to_target(cfg, target, Path(ckpt), notes)
    if verifier is not None:
        cfg = dataclasses.replace(cfg, verifier=verifier)
    if fmt == "vllm":
        config, tensors = vllm_config(cfg, dtype), vllm_tensors(cfg, arrays, dtype)
    else:
        config, tensors = speculators_config(cfg, dtype), speculators_tensors(cfg, arrays, dtype)
    report: dict = {}
    check = _inspect_gate(report, target, dest, force, "the exported folder would have", "write it anyway")
    folder = write_hf_folder(dest, config, tensors, max_shard_size=max_shard_size, overwrite=overwrite, check=check)
    report["notes"] = notes + report.get("notes", [])
    report["warnings"] = warnings + report.get("warnings", [])
    return folder, report


def as_eagle3(cfg):
    """A P-EAGLE head's config as a plain EAGLE-3 head's: mode chain, no mask token, so that its
    export holds no mask_hidden and no mask id (vLLM 0.34 and later load it and draft one token
    at a time). ConvertError for a head of another kind."""
    if cfg.mode != "parallel":
        raise ConvertError(f"--as eagle3 writes a P-EAGLE (parallel) head as EAGLE-3; this head's mode is {cfg.mode!r}")
    return dataclasses.replace(cfg, mode="chain", mask_token_id=None)


def as_eagle3_warning(cfg, ckpt) -> str:
    return (
        f"{ckpt}: a P-EAGLE head written as plain EAGLE-3 (mask_hidden and the mask token id left out): it was "
        f"trained to draft all {cfg.k_train or 'K'} tokens in one pass, and drafting one token at a time it accepts "
        "fewer (docs/benchmarks.md, 'A P-EAGLE head served as EAGLE-3')"
    )


def _fit_to_target(cfg, target, ckpt: Path, notes: list[str]):
    """(the target folder or None, `cfg` with max_position_embeddings raised to the target's when
    below it, as vLLM needs; a note says so)."""
    target, tinfo = _export_target(target, cfg.verifier, ckpt, notes)
    if tinfo is not None and cfg.max_position_embeddings < tinfo["max_position_embeddings"]:
        notes.append(
            f"max_position_embeddings raised from {cfg.max_position_embeddings} to the target's "
            f"{tinfo['max_position_embeddings']}"
        )
        cfg = dataclasses.replace(cfg, max_position_embeddings=tinfo["max_position_embeddings"])
    return target, cfg


def _inspect_gate(report: dict, target, dest: Path, force: bool, would: str, anyway: str):
    """The check a folder passes in its temporary place before it is renamed to `dest`: the lint
    (`inspect_folder`) fills `report`; a problem refuses it unless `force`."""

    def check(tmp: Path) -> None:
        report.update(inspect_folder(tmp, target=target, display=dest))
        if report["problems"] and not force:
            raise ConvertError(
                f"{dest}: {would} {len(report['problems'])} problem(s): "
                + "; ".join(report["problems"])
                + f" (pass --force to {anyway})"
            )

    return check


def _target_sources(folder: Path) -> dict:
    """read_drafter's `embeddings` and `target_weights` callables for a target folder, its
    weights read once, only when called. Not `load_target`: only the weights are needed, not an
    aux-id setup (tiny targets have no valid default ids)."""
    if not folder.is_dir():
        raise ConvertError(f"{folder}: no such target folder")
    loaded = {}

    def params():
        if not loaded:
            from peagle_jax.models.registry import target_config
            from peagle_jax.sources.weights import load_params

            loaded["params"] = load_params(folder, target_config(folder), "float32")
        return loaded["params"]

    def embeddings():  # as the target's first layer sees them (an EAGLE-3 head's)
        from peagle_jax.models.decoder import embedding_arrays

        return embedding_arrays(*params())[0]

    def target_weights():  # the stored rows and the lm_head (a DFlash head's)
        from peagle_jax.models.decoder import embedding_arrays

        return embedding_arrays(*params(), scaled=False)

    return {"embeddings": embeddings, "target_weights": target_weights}


def import_drafter_folder(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str = "float32",
    target: str | os.PathLike | None = None,
    overwrite: bool = False,
    force: bool = False,
):
    """A vLLM-native / speculators folder (or our checkpoint) -> our checkpoint at `out`.
    `target`: the target's HF folder, whose embeddings an EAGLE-3 head without embed_tokens
    takes (a DFlash head: its embeddings and lm_head), and which the head is checked against.
    The checkpoint is inspected in its temporary folder (`inspect_folder`, against `target`,
    else the recorded verifier when it is here) and refused, nothing written, when `inspect OUT`
    would report a problem (NaN / Inf weights, aux ids outside the target's layers, ...), unless
    `force`. With a target (`target`, else the recorded verifier when it is here), a
    max_position_embeddings below the target's is raised to it, as export does (a note).
    `src` and `target` may be Hub ids (`peagle_jax.sources.hub`).
    Returns (the head's DrafterConfig, the inspect report of OUT, its `notes` first)."""
    p, target = resolve(src, "head"), None if target is None else resolve(target, "target")
    if not p.exists():
        raise ConvertError(f"{p}: no such file or folder")
    if not p.is_dir():
        raise ConvertError(f"{p}: not a folder")
    dest = check_output(p, out)
    check_destination(dest, overwrite, OWN_CONFIG_FILE)
    sources = {} if target is None else _target_sources(Path(target))
    if not (p / OWN_CONFIG_FILE).exists() and not (p / CONFIG_FILE).exists():
        raise ConvertError(f"{p / CONFIG_FILE}: no such file (not a vLLM / speculators drafter folder)")
    config, arrays, _ = read_drafter(p, **sources)
    notes: list[str] = []
    target, config = _fit_to_target(config, target, p, notes)
    report: dict = {}
    check = _inspect_gate(report, target, dest, force, f"the imported checkpoint of {p} would have", "import it anyway")
    write_own(dest, config, arrays, dtype, allow_non_finite=True, check=check)  # the check reports NaN / Inf
    report["notes"] = notes + report.get("notes", [])
    return config, report


# ---------------------------------------------------------------------------------------
# targets
def _source_dtype(folder: Path) -> str:
    try:
        raw = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return "float32"
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    name = raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    return "bfloat16" if name in ("bfloat16", "bf16") else "float32"


def convert_target(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str = "auto",
    max_shard_size: int | str = DEFAULT_MAX_SHARD,
    overwrite: bool = False,
) -> Path:
    """Load a target's HF folder as `load_target` does (`registry.target_config` + `weights.load_params`:
    every tensor consumed, every shape checked; aux layer ids play no part here) and write it back
    (config.json + safetensors, sharded above `max_shard_size`, tokenizer files copied).
    dtype "auto" keeps bfloat16 sources in bfloat16 and reads everything else as float32; `src` may
    be a Hub id (`peagle_jax.sources.hub`)."""
    from peagle_jax.models.registry import hf_config, target_config
    from peagle_jax.sources.weights import TOKENIZER_FILES, load_params, target_tensors, tensors_dtype_name

    p = resolve(src, "target")
    if not p.exists():
        raise ConvertError(f"{p}: no such folder")
    if not p.is_dir():
        raise ConvertError(f"{p}: not a folder")
    parse_size(max_shard_size)
    dest = check_output(p, out)
    check_destination(dest, overwrite, CONFIG_FILE)
    refuse_head(p)  # a head or a run's folder, named as such (not a missing tensor of the target)
    d = _source_dtype(p) if dtype == "auto" else dtype
    tcfg = target_config(p)
    _, state = load_params(p, tcfg, d)
    tensors = target_tensors(tcfg, state)
    config = hf_config(tcfg)
    config["dtype"] = tensors_dtype_name(tensors)
    extra = [p / f for f in TOKENIZER_FILES if (p / f).exists()]
    return write_hf_folder(dest, config, tensors, max_shard_size=max_shard_size, overwrite=overwrite, extra_files=extra)


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

    defaults = DefaultsFormatter
    p = sub.add_parser(
        "export",
        formatter_class=defaults,
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

    p = sub.add_parser(
        "import",
        formatter_class=defaults,
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

    p = sub.add_parser(
        "inspect",
        formatter_class=defaults,
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
        p = sub.add_parser(name, help=text, description=text + "." + round_trip, formatter_class=defaults)
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
    return parser


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
