"""`python -m peagle_jax.convert` (console script `peagle-convert`): drafter and target checkpoints
between this project and the formats vLLM serves (reference/peagle.md section 6).

```
peagle-convert export CKPT OUT --format vllm|speculators [--dtype bfloat16|float32]
               [--max-shard-size 5GB] [--target DIR] [--verifier NAME] [--overwrite] [--force]
peagle-convert import SRC OUT [--dtype float32|bfloat16] [--target DIR] [--overwrite]
peagle-convert inspect DIR [--target DIR] [--json]
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
  `max_position_embeddings` below the target's is raised to it.
- `import`: a vLLM-native or speculators folder (EAGLE-3 or P-EAGLE) -> our checkpoint
  (`drafter.json` + `state/`), which `peagle_jax.load_drafter` and the trainer read.
- `inspect`: what a folder holds and every problem that would stop vLLM or silently cost acceptance
  (missing mask_hidden / embed_tokens, H != Ht, not 3 aux layers, a mask id outside the vocabulary,
  max_position_embeddings below the target's, wrong shapes, ...). Exit 1 when there is a problem.
  The target is `--target DIR`, else the recorded verifier path when it exists on this machine.
- `export-target` / `import-target`: a target model's Hugging Face folder, loaded and validated by
  `load_target` (every tensor consumed, every shape checked) and written back by this project
  (`weights.hf_tensors` + `TargetConfig.to_hf`, tokenizer files copied): the HF round trip.

Exit status: 0 ok, 1 a problem with the input or output (one line `error: ...` on stderr naming
the file and key), 2 a usage error. Normal output goes to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from peagle_jax.drafter import NUM_AUX, OWN_CONFIG_FILE
from peagle_jax.drafter_io import MASK_ID_KEYS
from peagle_jax.folders import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD,
    INDEX_FILE,
    SINGLE_FILE,
    check_destination,
    parse_size,
    write_hf_folder,
)

__all__ = [
    "main",
    "parse_size",
    "write_hf_folder",
    "export_drafter",
    "import_drafter_folder",
    "inspect_folder",
    "convert_target",
    "CONFIG_FILE",
    "INDEX_FILE",
    "SINGLE_FILE",
]

_LAYER0 = "layers.0."
_MID = "midlayer."


class ConvertError(Exception):
    """A problem with the input or the output (exit status 1)."""


# ---------------------------------------------------------------------------------------
# sizes and sharded safetensors folders


def _folder_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith(".safetensors"))


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in _folder_files(folder))


# ---------------------------------------------------------------------------------------
# drafter export / import
def _load_any_drafter(path: str | os.PathLike, dtype=None):
    from peagle_jax.drafter import load_drafter

    p = Path(path)
    if not p.exists():
        raise ConvertError(f"{p}: no such file or folder")
    if not p.is_dir():
        raise ConvertError(f"{p}: not a folder (a drafter checkpoint is a folder)")
    if not (p / OWN_CONFIG_FILE).exists() and not (p / CONFIG_FILE).exists():
        raise ConvertError(f"{p}: holds neither {OWN_CONFIG_FILE} (our checkpoint) nor {CONFIG_FILE} "
                           "(a vLLM / speculators folder)")
    return load_drafter(p, dtype=dtype)


def _read_config(path: Path) -> dict:
    from peagle_jax.config import ConfigError, read_json

    try:
        return read_json(path)
    except ConfigError as err:  # the callers treat any ConvertError as "no usable folder"
        raise ConvertError(str(err)) from None


def _target_info(folder: Path) -> dict:
    """Lenient facts about a target folder from its config.json (any family, multimodal too)."""
    cfg_file = folder / CONFIG_FILE
    raw = _read_config(cfg_file)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    info = {"path": str(folder), "model_type": raw.get("model_type"),
            "architectures": raw.get("architectures") or []}
    for key, name in (("num_hidden_layers", "num_layers"), ("hidden_size", "hidden_size"),
                      ("vocab_size", "vocab_size"), ("max_position_embeddings", "max_position_embeddings")):
        value = text.get(key, raw.get(key))
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConvertError(f"{cfg_file}: missing or invalid key {key!r}")
        info[name] = value
    return info


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
) -> tuple[Path, dict]:
    """Our checkpoint (or any folder `load_drafter` reads) -> a vLLM / speculators folder.
    Returns (folder, its inspect report)."""
    from peagle_jax import drafter_io
    from peagle_jax.drafter import Drafter

    if fmt not in ("vllm", "speculators"):
        raise ConvertError(f"unknown format {fmt!r} (vllm, speculators)")
    parse_size(max_shard_size)
    dest = Path(out).absolute()
    check_destination(dest, overwrite, CONFIG_FILE)
    drafter = _load_any_drafter(ckpt)
    cfg = drafter.config
    notes = []
    tinfo = None
    if target is not None:
        tinfo = _target_info(Path(target))
    else:  # the recorded target, when it is on this machine
        found = _resolve_verifier(cfg.verifier, Path(ckpt))
        if found is not None:
            try:
                tinfo = _target_info(found)
                target = found
                notes.append(f"checked against the recorded target {found}")
            except ConvertError:
                pass
    if tinfo is not None and cfg.max_position_embeddings < tinfo["max_position_embeddings"]:
        notes.append(f"max_position_embeddings raised from {cfg.max_position_embeddings} to the target's "
                     f"{tinfo['max_position_embeddings']}")
        cfg = dataclasses.replace(cfg, max_position_embeddings=tinfo["max_position_embeddings"])
        drafter = Drafter(cfg, drafter.graphdef, drafter.state, path=drafter.path)
    if fmt == "vllm":
        config = drafter_io.vllm_config(drafter, dtype)
        tensors = drafter_io.hf_tensors(drafter, dtype, _MID)
    else:
        config = drafter_io.speculators_config(drafter, dtype, verifier)
        tensors = drafter_io.speculators_tensors(drafter, dtype)
    report: dict = {}

    def check(tmp: Path) -> None:
        report.update(inspect_folder(tmp, target=target, _display=dest))
        if report["problems"] and not force:
            raise ConvertError(f"{dest}: the exported folder would have {len(report['problems'])} problem(s): "
                               + "; ".join(report["problems"]) + " (pass --force to write it anyway)")

    folder = write_hf_folder(dest, config, tensors, max_shard_size=max_shard_size, overwrite=overwrite,
                             check=check)
    report["notes"] = notes + report.get("notes", [])
    return folder, report


def import_drafter_folder(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str = "float32",
    target: str | os.PathLike | None = None,
    overwrite: bool = False,
):
    """A vLLM-native / speculators folder (or our checkpoint) -> our checkpoint at `out`."""
    from peagle_jax import drafter_io

    p = Path(src)
    if not p.exists():
        raise ConvertError(f"{p}: no such file or folder")
    if not p.is_dir():
        raise ConvertError(f"{p}: not a folder")
    dest = Path(out).absolute()
    check_destination(dest, overwrite, OWN_CONFIG_FILE)
    tgt = None
    if target is not None:  # only its embeddings are used: load the weights, skip the aux-id setup
        from types import SimpleNamespace

        from peagle_jax.config import TargetConfig
        from peagle_jax.weights import load_params

        tpath = Path(target)
        if not tpath.is_dir():
            raise ConvertError(f"{tpath}: no such target folder")
        tcfg = TargetConfig.from_hf(tpath)
        graphdef, state = load_params(tpath, tcfg, "float32")
        tgt = SimpleNamespace(config=tcfg, graphdef=graphdef, state=state, path=tpath)
    if not (p / OWN_CONFIG_FILE).exists() and not (p / CONFIG_FILE).exists():
        raise ConvertError(f"{p / CONFIG_FILE}: no such file (not a vLLM / speculators drafter folder)")
    drafter = drafter_io.import_drafter(p, target=tgt, dtype=dtype)
    drafter.save(dest)
    return drafter


# ---------------------------------------------------------------------------------------
# inspect
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _resolve_verifier(name, folder: Path) -> Path | None:
    if not name or not isinstance(name, str):
        return None
    cands = [Path(name)] if Path(name).is_absolute() else [folder / name, Path.cwd() / name]
    for c in cands:
        if (c / CONFIG_FILE).is_file():
            return c.resolve()
    return None


def _rope_summary(tl: dict) -> str:
    params = tl.get("rope_parameters")
    if not isinstance(params, dict):
        scaling = tl.get("rope_scaling") or {}
        params = {**(scaling if isinstance(scaling, dict) else {}), "rope_theta": tl.get("rope_theta", 10000.0)}
    kind = params.get("rope_type", params.get("type", "default"))
    extra = {k: v for k, v in params.items() if k not in ("rope_type", "type")}
    return f"{kind} " + ", ".join(f"{k}={v}" for k, v in sorted(extra.items()))


def _rope_type(cfg: dict) -> str | None:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        params = params["full_attention"]
    if not isinstance(params, dict):
        params = cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        return None
    return params.get("rope_type", params.get("type", "default"))


def inspect_folder(path: str | os.PathLike, *, target: str | os.PathLike | None = None, _display=None) -> dict:
    """A report (dict) of a drafter folder: what it is, `problems` (stop vLLM or silently cost
    acceptance), `warnings` and `notes`. Reads config.json and the safetensors headers (plus the
    small d2t/t2d tensors), never the weights."""
    folder = Path(path)
    shown = Path(_display) if _display is not None else folder
    if not folder.exists():
        raise ConvertError(f"{folder}: no such folder")
    if not folder.is_dir():
        raise ConvertError(f"{folder}: not a folder")
    if (folder / OWN_CONFIG_FILE).exists():
        return _inspect_own(folder, shown, target)
    return _Inspector(folder, shown, _read_config(folder / CONFIG_FILE), target).run()


class _Inspector:
    def __init__(self, folder: Path, shown: Path, raw: dict, target):
        self.folder, self.shown, self.raw = folder, shown, raw
        self.target_arg = target
        self.problems: list[str] = []
        self.warnings: list[str] = []
        self.notes: list[str] = []
        self.where = str(shown / CONFIG_FILE)

    def problem(self, msg: str) -> None:
        if msg not in self.problems:
            self.problems.append(msg)

    def warn(self, msg: str) -> None:
        if msg not in self.warnings:
            self.warnings.append(msg)

    # -- config ------------------------------------------------------------------------
    def _layer_config(self) -> tuple[str, dict, str]:
        from peagle_jax.drafter_io import SPECULATORS_TYPES, VLLM_ARCHITECTURES

        raw = self.raw
        if "speculators_model_type" in raw:
            kind = raw["speculators_model_type"]
            if kind not in SPECULATORS_TYPES:
                raise ConvertError(f"{self.where}: key 'speculators_model_type' is {kind!r} "
                                   f"(supported: {', '.join(SPECULATORS_TYPES)})")
            tl = raw.get("transformer_layer_config")
            if not isinstance(tl, dict):
                raise ConvertError(f"{self.where}: missing key 'transformer_layer_config'")
            return "speculators", tl, kind
        arch = raw.get("architectures") or []
        known = [a for a in arch if a in VLLM_ARCHITECTURES] if isinstance(arch, list) else []
        if not known:
            raise ConvertError(f"{self.where}: key 'architectures' is {arch!r}, not a drafter head "
                               f"(known: {', '.join(VLLM_ARCHITECTURES)}, or a speculators config)")
        return "vllm", raw, known[0]

    def run(self) -> dict:
        fmt, tl, arch = self._layer_config()
        raw = self.raw
        tl_where = self.where if fmt == "vllm" else f"{self.where} key 'transformer_layer_config'"
        fields = {}
        for key in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "intermediate_size"):
            value = tl.get(key)
            if not _is_int(value) or value <= 0:
                raise ConvertError(f"{tl_where}: missing or invalid key {key!r}")
            fields[key] = value
        h, n_layers, v = fields["hidden_size"], fields["num_hidden_layers"], fields["vocab_size"]
        vd = raw.get("draft_vocab_size") or v
        ht = raw.get("target_hidden_size") or h
        eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
        extra = raw.get("peagle_jax") if isinstance(raw.get("peagle_jax"), dict) else {}

        # mask id
        if fmt == "vllm":
            ids = {k: raw[k] for k in MASK_ID_KEYS if raw.get(k) is not None}
        else:
            ids = {"mask_token_id": raw["mask_token_id"]} if raw.get("mask_token_id") is not None else {}
        mask_id = next(iter(ids.values())) if ids else None

        # tensors
        ckpt, keys = self._checkpoint()
        has_mask_hidden = "mask_hidden" in keys
        if fmt == "speculators":
            mode = "parallel" if arch == "peagle" else "chain"
        else:
            mode = extra.get("mode") or ("parallel" if (ids or has_mask_hidden) else "chain")
        aux_top, aux_inner = raw.get("eagle_aux_hidden_state_layer_ids"), eagle.get("eagle_aux_hidden_state_layer_ids")
        aux = aux_top if aux_top is not None else aux_inner
        k_hints = {}
        if fmt == "speculators":
            spec = raw.get("speculators_config") if isinstance(raw.get("speculators_config"), dict) else {}
            methods = spec.get("proposal_methods") or []
            if methods and isinstance(methods[0], dict) and methods[0].get("speculative_tokens") is not None:
                k_hints["speculative_tokens"] = methods[0]["speculative_tokens"]
            verifier = (spec.get("verifier") or {}).get("name_or_path") if isinstance(spec.get("verifier"), dict) \
                else None
        else:
            verifier = extra.get("verifier")
        if extra.get("k_train") is not None:
            k_hints["k_train"] = extra["k_train"]
        for key in ("num_speculative_tokens", "parallel_drafting_k", "k_train"):
            if raw.get(key) is not None:
                k_hints[key] = raw[key]

        report: dict[str, Any] = {
            "path": str(self.shown),
            "format": fmt,
            "architecture": arch if fmt == "vllm" else raw.get("architectures"),
            "speculators_model_type": arch if fmt == "speculators" else None,
            "mode": mode,
            "num_layers": n_layers,
            "hidden_size": h,
            "target_hidden_size": ht,
            "vocab_size": v,
            "draft_vocab_size": vd,
            "mask_token_id": mask_id,
            "mask_token_keys": sorted(ids),
            "aux_layer_ids": aux,
            "k_hints": k_hints,
            # the effective value (vLLM: speculators eagle3 heads default to true, everything else false)
            "norm_before_residual": raw.get("norm_before_residual")
            if raw.get("norm_before_residual") is not None else (fmt == "speculators" and arch == "eagle3"),
            "max_position_embeddings": tl.get("max_position_embeddings"),
            "rope": _rope_summary(tl).strip(),
            "layer0_prefix": None,
            "tensors": len(keys),
            "files": [p.name for p in _folder_files(self.folder)],
            "bytes": _folder_bytes(self.folder),
            "dtype": None,
            "target": None,
        }

        # -- problems from the config --------------------------------------------------
        if fmt == "speculators" and "model_type" in raw:
            self.warn(f"top-level key 'model_type' ({raw['model_type']!r}) in a speculators config: vLLM may "
                      "take it for a plain model config; speculators configs have none")
        if _is_int(vd) and _is_int(v) and vd > v:
            self.problem(f"draft_vocab_size {vd} > vocab_size {v}")
        if not _is_int(ht) or ht != h:
            self.problem(f"hidden_size {h} != target_hidden_size {ht}: vLLM's EAGLE-3 / P-EAGLE heads need the "
                         "drafter hidden size to equal the target's")
        aux_ok = False
        if aux_top is not None and aux_inner is not None and aux_top != aux_inner:
            self.problem(f"eagle_aux_hidden_state_layer_ids {aux_top} differs from "
                         f"eagle_config.eagle_aux_hidden_state_layer_ids {aux_inner}")
        elif aux is None:
            self.warn("no eagle_aux_hidden_state_layer_ids: vLLM falls back to (2, L//2, L-3) of the target; "
                      "make sure the head was trained on those layers")
        elif not isinstance(aux, list) or not all(_is_int(i) for i in aux):
            self.problem(f"eagle_aux_hidden_state_layer_ids {aux!r} is not a list of layer ids")
        elif len(aux) != NUM_AUX:
            self.problem(f"eagle_aux_hidden_state_layer_ids lists {len(aux)} layers {aux}; vLLM's EAGLE-3 heads "
                         f"use exactly {NUM_AUX} aux layers (fc reads 3 * target_hidden_size)")
        else:
            aux_ok = True
            if len(set(aux)) != NUM_AUX or aux != sorted(aux) or min(aux) < 0:
                self.problem(f"eagle_aux_hidden_state_layer_ids {aux} must be 3 distinct non-negative ids in "
                             "layer order")
            if fmt == "vllm" and aux_top is None:
                self.warn("eagle_aux_hidden_state_layer_ids only inside eagle_config: older vLLM releases read "
                          "the top-level key")
        if mode == "parallel":
            if mask_id is None:
                keys_txt = "mask_token_id" if fmt == "speculators" else "/".join(MASK_ID_KEYS)
                self.problem(f"no mask token id ({keys_txt}): a parallel (P-EAGLE) head needs one for "
                             "parallel_drafting")
            elif len({str(x) for x in ids.values()}) > 1:
                self.problem(f"the mask token keys disagree: {ids}")
            elif not _is_int(mask_id) or not 0 <= mask_id < v:
                self.problem(f"mask token id {mask_id!r} ({', '.join(sorted(ids))}) outside the vocabulary "
                             f"[0, {v})")
            elif fmt == "vllm" and len(ids) < len(MASK_ID_KEYS):
                missing = [k for k in MASK_ID_KEYS if k not in ids]
                self.warn(f"mask token id only under {sorted(ids)}, not {missing}: different vLLM releases read "
                          "different keys")
        if fmt == "vllm" and eagle.get("use_aux_hidden_state") is False:
            self.problem("eagle_config.use_aux_hidden_state is false: an EAGLE-1 head, not EAGLE-3 / P-EAGLE")
        if raw.get("tie_word_embeddings") or tl.get("tie_word_embeddings"):
            self.warn("tie_word_embeddings is true: drafter heads keep a separate lm_head [Vd, H]")

        # -- tensors against the expected table -----------------------------------------
        if ckpt is not None:
            self._check_tensors(fmt, ckpt, keys, mode, aux_ok, report)

        # -- target ----------------------------------------------------------------------
        self._check_target(report, verifier, ht, v, aux if aux_ok else None, tl.get("max_position_embeddings"),
                           _rope_type(tl), aux_missing=aux is None)

        if mode == "chain":
            self.notes.append("EAGLE-3 chain head (no parallel drafting): serve without parallel_drafting")
        report.update(problems=self.problems, warnings=self.warnings, notes=self.notes)
        return report

    def _checkpoint(self):
        from peagle_jax.weights import Checkpoint, WeightsError

        try:
            ckpt = Checkpoint(self.folder)
        except WeightsError as err:
            self.problem(str(err).replace(str(self.folder), str(self.shown)))
            return None, set()
        return ckpt, set(ckpt.keys())

    def _sanitized_config(self, fmt: str, mode: str):
        """A DrafterConfig for the expected tensor table, with the problems already reported
        (aux ids, mask id) neutralised so the shape checks still run."""
        from peagle_jax.config import ConfigError
        from peagle_jax.drafter_io import read_speculators_config, read_vllm_config

        raw = json.loads(json.dumps(self.raw))
        v = (raw.get("transformer_layer_config") or raw).get("vocab_size")
        for key in ("eagle_aux_hidden_state_layer_ids",):
            raw.pop(key, None)
            if isinstance(raw.get("eagle_config"), dict):
                raw["eagle_config"].pop(key, None)
        present = [k for k in MASK_ID_KEYS if raw.get(k) is not None]
        if mode == "parallel":
            value = raw.get(present[0]) if present else 0
            if not _is_int(value) or not 0 <= value < v:
                value = 0
            for k in (MASK_ID_KEYS if fmt == "vllm" else ("mask_token_id",)):
                raw[k] = value
        else:
            for k in MASK_ID_KEYS:
                raw.pop(k, None)
        if isinstance(raw.get("peagle_jax"), dict):
            raw["peagle_jax"]["mode"] = mode
        if _is_int(raw.get("draft_vocab_size")) and _is_int(v) and raw["draft_vocab_size"] > v:
            raw["draft_vocab_size"] = v
        try:
            if fmt == "speculators":
                return read_speculators_config(raw, self.where)
            return read_vllm_config(raw, self.where)
        except ConfigError as err:
            self.problem(str(err))
            return None

    def _check_tensors(self, fmt: str, ckpt, keys: set, mode: str, aux_ok: bool, report: dict) -> None:
        import numpy as np

        from peagle_jax.drafter import abstract_drafter, flat_state, t2d_from_d2t
        from peagle_jax.drafter_io import key_table

        mid = any(k.startswith(_MID) for k in keys)
        l0 = any(k.startswith(_LAYER0) for k in keys)
        report["layer0_prefix"] = "midlayer." if mid else ("layers.0." if l0 else None)
        if mid and l0:
            self.problem("both 'midlayer.*' and 'layers.0.*' tensors: layer 0 must be one or the other")
        if mid and fmt == "speculators":
            self.warn("'midlayer.*' tensors in a speculators folder: speculators names layer 0 'layers.0.*'")
        dtypes = sorted({ckpt.dtype(k) for k in keys if k not in ("d2t", "t2d")})
        report["dtype"] = ",".join(dtypes) if dtypes else None

        def where(key):
            return str(ckpt.where[key]).replace(str(self.folder), str(self.shown))

        # the listed problems first: they hold whatever the config says
        if mode == "parallel" and "mask_hidden" not in keys:
            self.problem("missing tensor 'mask_hidden' [1, 1, 3*Ht]: vLLM raises when parallel_drafting is on "
                         "(and speculators' from_pretrained silently fills it with random values)")
        if "embed_tokens.weight" not in keys:
            if mode == "parallel":
                self.problem("missing tensor 'embed_tokens.weight': vLLM would share the target's embeddings, "
                             "whose mask-token row was never trained")
            else:
                self.warn("no 'embed_tokens.weight': vLLM shares the target's embeddings (fine for an EAGLE-3 "
                          "head trained with frozen embeddings)")
        cfg = self._sanitized_config(fmt, mode)
        if cfg is None:
            return
        _, abstract = abstract_drafter(cfg)
        flat = flat_state(abstract)
        consumed = set()
        for key, ours, transform in key_table(cfg):
            name = _MID + key[len(_LAYER0):] if mid and key.startswith(_LAYER0) else key
            shape = tuple(flat[ours].shape)
            want = tuple(reversed(shape)) if transform == "linear" else shape
            if name not in keys:
                if name in ("embed_tokens.weight", "mask_hidden"):
                    continue  # reported above
                if name == "d2t" and cfg.draft_vocab_size == cfg.vocab_size:
                    continue
                self.problem(f"missing tensor {name!r} (expected shape {list(want)})")
                continue
            consumed.add(name)
            got = ckpt.shape(name)
            dt = ckpt.dtype(name)
            if transform == "d2t":
                if not dt.startswith(("I", "U")):
                    self.problem(f"{where(name)}: tensor 'd2t' has dtype {dt}, expected int64")
                elif got != want:
                    self.problem(f"{where(name)}: tensor 'd2t' has shape {list(got)}, expected {list(want)}")
                else:
                    d2t = np.asarray(ckpt.read(name)).astype(np.int64)
                    tgt = np.arange(want[0], dtype=np.int64) + d2t
                    if tgt.min() < 0 or tgt.max() >= cfg.vocab_size or np.unique(tgt).size != want[0]:
                        self.problem(f"{where(name)}: tensor 'd2t' maps draft ids outside [0, {cfg.vocab_size}) "
                                     "or onto one target id twice")
                    elif "t2d" in keys:
                        t2d = np.asarray(ckpt.read("t2d"))
                        if t2d.shape != (cfg.vocab_size,) or not np.array_equal(
                                t2d.astype(bool), t2d_from_d2t(d2t, cfg.vocab_size)):
                            self.problem(f"{where('t2d')}: tensor 't2d' does not match 'd2t'")
                continue
            if dt not in ("F32", "BF16", "F16", "F64"):
                self.problem(f"{where(name)}: tensor {name!r} has dtype {dt}, expected a float type")
            if transform == "mask":
                if got != want:
                    if math.prod(got) == math.prod(want) and len(got) <= 3:
                        self.warn(f"{where(name)}: tensor 'mask_hidden' has shape {list(got)}; vLLM expects "
                                  f"{list(want)}")
                    else:
                        self.problem(f"{where(name)}: tensor 'mask_hidden' has shape {list(got)}, expected "
                                     f"{list(want)} (3 * target_hidden_size values, before fc)")
            elif got != want:
                self.problem(f"{where(name)}: tensor {name!r} has shape {list(got)}, expected {list(want)}")
        if cfg.draft_vocab_size < cfg.vocab_size and "d2t" not in keys:
            self.problem(f"missing tensor 'd2t' [{cfg.draft_vocab_size}] (int64): draft vocab "
                         f"{cfg.draft_vocab_size} < vocab {cfg.vocab_size} needs the id map")
        if "t2d" in keys:
            consumed.add("t2d")
        extra = sorted(keys - consumed - {"embed_tokens.weight", "mask_hidden"})
        if extra:
            self.problem(f"unexpected tensor(s) {extra[:5]}{' ...' if len(extra) > 5 else ''} for this config "
                         f"({cfg.num_layers} layers, mode {cfg.mode}); vLLM cannot load them")

    def _check_target(self, report: dict, verifier, ht, v, aux, max_pos, rope_type, aux_missing=False) -> None:
        if self.target_arg is not None:
            tfolder = Path(self.target_arg)
            if not tfolder.is_dir():
                raise ConvertError(f"{tfolder}: no such target folder")
            t = _target_info(tfolder)
        else:
            tfolder = _resolve_verifier(verifier, self.folder)
            if tfolder is None:
                if verifier:
                    self.notes.append(f"target {verifier!r} not found on this machine (pass --target DIR to "
                                      "check the head against it)")
                return
            try:
                t = _target_info(tfolder)
            except ConvertError as err:
                self.notes.append(f"recorded target not usable for checks: {err}")
                return
        report["target"] = t
        if _is_int(ht) and t["hidden_size"] != ht:
            self.problem(f"target_hidden_size {ht} != the target's hidden_size {t['hidden_size']} ({tfolder})")
        if _is_int(v) and t["vocab_size"] != v:
            self.problem(f"vocab_size {v} != the target's vocab_size {t['vocab_size']} ({tfolder})")
        n = t["num_layers"]
        if aux is not None and any(not 0 <= i < n for i in aux):
            self.problem(f"eagle_aux_hidden_state_layer_ids {aux} outside the target's {n} layers [0, {n})")
        if aux_missing and n:
            self.notes.append(f"vLLM will use the default aux layers {[2, n // 2, n - 3]} of this {n}-layer target")
        if not _is_int(max_pos):
            self.problem("no max_position_embeddings in the drafter config")
        elif max_pos < t["max_position_embeddings"]:
            self.problem(f"max_position_embeddings {max_pos} < the target's {t['max_position_embeddings']} "
                         f"({tfolder}): vLLM refuses or stops speculating past the drafter's limit")
        trope = _rope_type(json.loads((tfolder / CONFIG_FILE).read_text()))
        if trope is not None and rope_type is not None and trope != rope_type:
            self.notes.append(f"drafter rope '{rope_type}' differs from the target's '{trope}' (deliberate for the "
                              "AWS GPT-OSS heads: llama3 on a YaRN target; check it matches training)")


def _inspect_own(folder: Path, shown: Path, target) -> dict:
    from peagle_jax.config import ConfigError
    from peagle_jax.drafter import DrafterConfig

    cfg_file = folder / OWN_CONFIG_FILE
    try:
        meta = json.loads(cfg_file.read_text())
        cfg = DrafterConfig.from_dict(meta.get("config") or {}, str(shown / OWN_CONFIG_FILE))
    except (OSError, ValueError) as err:
        raise ConvertError(f"{shown / OWN_CONFIG_FILE}: {err}") from None
    except ConfigError as err:
        raise ConvertError(str(err)) from None
    ins = _Inspector(folder, shown, {}, target)
    if cfg.hidden_size != cfg.target_hidden_size:
        ins.problem(f"hidden_size {cfg.hidden_size} != target_hidden_size {cfg.target_hidden_size}: vLLM's "
                    "EAGLE-3 / P-EAGLE heads need the drafter hidden size to equal the target's")
    if cfg.aux_layer_ids is None:
        ins.warn("no aux_layer_ids: vLLM falls back to (2, L//2, L-3) of the target")
    if not (folder / "state").is_dir():
        ins.problem(f"{shown / 'state'}: missing (our checkpoint holds drafter.json and state/)")
    report = {
        "path": str(shown), "format": "own", "architecture": None, "speculators_model_type": None,
        "mode": cfg.mode, "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.target_hidden_size, "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size, "mask_token_id": cfg.mask_token_id, "mask_token_keys": [],
        "aux_layer_ids": None if cfg.aux_layer_ids is None else list(cfg.aux_layer_ids),
        "k_hints": {} if cfg.k_train is None else {"k_train": cfg.k_train},
        "norm_before_residual": cfg.norm_before_residual,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope": " ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg.rope).items()),
        "layer0_prefix": None, "tensors": None, "files": [], "bytes": None, "dtype": meta.get("dtype"),
        "target": None,
    }
    ins._check_target(report, cfg.verifier, cfg.target_hidden_size, cfg.vocab_size,
                      None if cfg.aux_layer_ids is None else list(cfg.aux_layer_ids),
                      cfg.max_position_embeddings, cfg.rope.type, aux_missing=cfg.aux_layer_ids is None)
    report.update(problems=ins.problems, warnings=ins.warnings, notes=ins.notes)
    return report


def format_report(r: dict) -> str:
    mode = {"parallel": "parallel (P-EAGLE)", "chain": "chain (EAGLE-3)"}.get(r["mode"], r["mode"])
    fmt = r["format"] + (f" ({r['architecture']})" if isinstance(r["architecture"], str) else "")
    if r.get("speculators_model_type"):
        fmt += f" (speculators_model_type {r['speculators_model_type']})"
    vocab = f"{r['vocab_size']} (draft {r['draft_vocab_size']})"
    mask = "none" if r["mask_token_id"] is None else str(r["mask_token_id"])
    if r["mask_token_keys"]:
        mask += f" ({', '.join(r['mask_token_keys'])})"
    k = ", ".join(f"{a}={b}" for a, b in r["k_hints"].items()) or "none recorded"
    ints = [x for x in r["k_hints"].values() if _is_int(x)]
    if ints:
        k += f" (serve with num_speculative_tokens <= {max(ints)})"
    lines = [
        f"{r['path']}",
        f"  format       {fmt}",
        f"  mode         {mode}",
        f"  layers       {r['num_layers']}",
        f"  hidden       {r['hidden_size']} (target hidden {r['target_hidden_size']})",
        f"  vocab        {vocab}",
        f"  mask id      {mask}",
        f"  aux ids      {r['aux_layer_ids']} (vLLM convention: residual stream entering those target layers)",
        f"  K hints      {k}",
        f"  max pos      {r['max_position_embeddings']}",
        f"  rope         {r['rope']}",
    ]
    if r["files"]:
        lines.append(f"  tensors      {r['tensors']} in {len(r['files'])} file(s), {r['bytes'] / 1e6:.2f} MB, "
                     f"{r['dtype']}" + (f", layer 0 as {r['layer0_prefix']}*" if r["layer0_prefix"] else ""))
    t = r["target"]
    lines.append(f"  target       {t['path']} ({t['model_type']}, {t['num_layers']} layers, hidden "
                 f"{t['hidden_size']}, vocab {t['vocab_size']}, max pos {t['max_position_embeddings']})"
                 if t else "  target       unknown")
    for title, items in (("problems", r["problems"]), ("warnings", r["warnings"]), ("notes", r["notes"])):
        if items:
            lines.append(f"{title} ({len(items)}):")
            lines += [f"  - {x}" for x in items]
    lines.append(f"{len(r['problems'])} problem(s)" if r["problems"] else "OK: no problems")
    return "\n".join(lines)


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
    """Load a target's HF folder as `load_target` does (`TargetConfig.from_hf` + `weights.load_params`:
    every tensor consumed, every shape checked; aux layer ids play no part here) and write it back
    (config.json + safetensors, sharded above `max_shard_size`, tokenizer files copied).
    dtype "auto" keeps bfloat16 sources in bfloat16 and reads everything else as float32."""
    import ml_dtypes
    import numpy as np

    from peagle_jax.config import TargetConfig
    from peagle_jax.target import TOKENIZER_FILES
    from peagle_jax.weights import hf_tensors, load_params

    p = Path(src)
    if not p.exists():
        raise ConvertError(f"{p}: no such folder")
    if not p.is_dir():
        raise ConvertError(f"{p}: not a folder")
    parse_size(max_shard_size)
    dest = Path(out).absolute()
    check_destination(dest, overwrite, CONFIG_FILE)
    d = _source_dtype(p) if dtype == "auto" else dtype
    tcfg = TargetConfig.from_hf(p)
    _, state = load_params(p, tcfg, d)
    tensors = hf_tensors(tcfg, state)
    config = tcfg.to_hf()
    config["dtype"] = "bfloat16" if {a.dtype for a in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)} \
        else "float32"
    extra = [p / f for f in TOKENIZER_FILES if (p / f).exists()]
    return write_hf_folder(dest, config, tensors, max_shard_size=max_shard_size, overwrite=overwrite,
                           extra_files=extra)


# ---------------------------------------------------------------------------------------
# command line
class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (`error: ...`, exit 2)."""

    def error(self, message):  # noqa: D401
        raise _Usage(f"{self.prog}: {message} (see --help)")


class _Usage(Exception):
    pass


def _size_arg(text: str) -> str:
    try:
        parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="peagle-convert", description="Drafter and target checkpoints <-> vLLM / speculators "
                     "formats (python -m peagle_jax.convert).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    p = sub.add_parser("export", help="our drafter checkpoint -> vLLM-native or speculators folder",
                       description="Our drafter checkpoint (or any folder load_drafter reads) -> config.json + "
                       "model.safetensors in the vLLM-native EAGLE-3 layout (serve with parallel_drafting: true) "
                       "or the speculators layout. Written atomically; refused when inspect finds a problem.")
    p.add_argument("ckpt", metavar="CKPT", help="drafter checkpoint folder")
    p.add_argument("out", metavar="OUT", help="output folder")
    p.add_argument("--format", required=True, choices=["vllm", "speculators"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="float tensors' dtype (default bfloat16; d2t stays int64, t2d bool)")
    p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD, type=_size_arg,
                   help=f"shard above this size (default {DEFAULT_MAX_SHARD}; e.g. 500MB, 2GiB, bytes)")
    p.add_argument("--target", metavar="DIR", help="the target's HF folder: checked against, and its "
                   "max_position_embeddings used when larger than the drafter's")
    p.add_argument("--verifier", metavar="NAME", help="speculators: verifier name_or_path to record "
                   "(default: the one the drafter recorded)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT folder")
    p.add_argument("--force", action="store_true", help="write even when inspect reports problems")

    p = sub.add_parser("import", help="vLLM-native / speculators folder -> our drafter checkpoint",
                       description="A vLLM-native EAGLE-3 / P-EAGLE folder (midlayer.* or layers.0.*, with or "
                       "without attention bias, draft vocab with d2t) or a speculators peagle / eagle3 folder -> "
                       "our checkpoint (drafter.json + state/), loaded by peagle_jax.load_drafter.")
    p.add_argument("src", metavar="SRC", help="source folder")
    p.add_argument("out", metavar="OUT", help="output checkpoint folder")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="parameter dtype of our checkpoint (default float32: exact for bf16 sources)")
    p.add_argument("--target", metavar="DIR", help="target HF folder: embeddings for an EAGLE-3 head that ships "
                   "none")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT checkpoint")

    p = sub.add_parser("inspect", help="describe a drafter folder and list what would break vLLM",
                       description="What a drafter folder is (format, mode, layers, vocab sizes, mask id, aux ids, "
                       "K hints) and every problem that would stop vLLM or silently degrade it. Exit 1 when there "
                       "are problems.")
    p.add_argument("dir", metavar="DIR", help="drafter folder (vLLM, speculators or ours)")
    p.add_argument("--target", metavar="DIR", help="target HF folder to check against (default: the recorded "
                   "verifier path, when it exists here)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")

    for name, text in (("export-target", "a target's HF folder -> an HF folder written by this project"),
                       ("import-target", "a target's HF folder -> validated and normalised by this project")):
        p = sub.add_parser(name, help=text, description=text + " (load_target, then weights.hf_tensors + "
                           "TargetConfig.to_hf; tokenizer files copied; atomic).")
        p.add_argument("src", metavar="SRC_HF", help="Hugging Face model folder")
        p.add_argument("out", metavar="OUT", help="output folder")
        p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                       help="auto (default): bfloat16 sources stay bfloat16, others float32")
        p.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD, type=_size_arg,
                       help=f"shard above this size (default {DEFAULT_MAX_SHARD})")
        p.add_argument("--overwrite", action="store_true", help="replace an existing OUT folder")
    return parser


def _serve_hint(fmt: str, out: Path, report: dict) -> str:
    k = max([int(x) for x in report.get("k_hints", {}).values() if _is_int(x)] or [7])
    if fmt == "vllm":
        spec = {"method": "eagle3", "model": str(out), "num_speculative_tokens": k}
        if report.get("mode") == "parallel":
            spec["parallel_drafting"] = True
    else:
        spec = {"model": str(out), "num_speculative_tokens": k}
    return f"serve: vllm serve TARGET --speculative-config '{json.dumps(spec)}'"


def _run(args) -> int:
    out = sys.stdout
    if args.command == "export":
        folder, report = export_drafter(args.ckpt, args.out, args.format, dtype=args.dtype,
                                        max_shard_size=args.max_shard_size, target=args.target,
                                        verifier=args.verifier, overwrite=args.overwrite, force=args.force)
        report["path"] = str(folder)
        print(f"wrote {folder} ({args.format}, {args.dtype}, {len(report['files'])} file(s))", file=out)
        for n in report.get("notes", []):
            print(f"note: {n}", file=out)
        for w in report.get("warnings", []):
            print(f"warning: {w}", file=sys.stderr)
        for p in report.get("problems", []):
            print(f"warning: (forced) {p}", file=sys.stderr)
        print(_serve_hint(args.format, folder, report), file=out)
        return 0
    if args.command == "import":
        drafter = import_drafter_folder(args.src, args.out, dtype=args.dtype, target=args.target,
                                        overwrite=args.overwrite)
        print(f"wrote {Path(args.out).absolute()}: {drafter!r}", file=out)
        return 0
    if args.command == "inspect":
        report = inspect_folder(args.dir, target=args.target)
        print(json.dumps(report, indent=2) if args.json else format_report(report), file=out)
        return 1 if report["problems"] else 0
    if args.command in ("export-target", "import-target"):
        folder = convert_target(args.src, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                                overwrite=args.overwrite)
        print(f"wrote {folder}", file=out)
        return 0
    raise _Usage(f"unknown command {args.command!r}")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI. Returns the exit status (0 ok, 1 problem, 2 usage)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _Usage as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    except SystemExit as err:  # --help
        return int(err.code or 0)
    try:
        return _run(args)
    except _Usage as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 1
    except Exception as err:  # noqa: BLE001 - every failure is one line; PEAGLE_DEBUG=1 shows the traceback
        if os.environ.get("PEAGLE_DEBUG"):
            raise
        known = isinstance(err, (ConvertError, ValueError, OSError, KeyError))
        msg = _one_line(err) or type(err).__name__
        print(f"error: {msg}" if known else f"error: {type(err).__name__}: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
