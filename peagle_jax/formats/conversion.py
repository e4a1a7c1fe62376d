"""The converter's operations (its command line: `peagle_jax.formats.convert`): a head exported
to the folders vLLM and speculators load (`export_drafter`), a vLLM / speculators head imported as
our checkpoint (`import_drafter_folder`), a target's Hugging Face folder written back by this
project (`convert_target`). Each writes a temporary sibling, inspects it there and renames it into
place, or refuses (nothing written) when the lint reports a problem, unless forced."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from peagle_jax.config.target_config import ConfigError
from peagle_jax.formats.checkpoints import read_drafter, speculators_tensors, vllm_tensors
from peagle_jax.formats.head_config import refuse_head, run_folder_of
from peagle_jax.formats.head_config_write import speculators_config, vllm_config
from peagle_jax.formats.inspect import inspect_folder
from peagle_jax.formats.own import OWN_CONFIG_FILE, write_own
from peagle_jax.formats.serving import resolve_verifier, target_facts
from peagle_jax.runtime.command_line import UsageError
from peagle_jax.runtime.folders import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD,
    check_destination,
    parse_size,
    unwritable,
    write_hf_folder,
)
from peagle_jax.sources.hub import repo_id_of, resolve

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
