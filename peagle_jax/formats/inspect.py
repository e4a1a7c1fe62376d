"""The checkpoint lint (`peagle-convert inspect DIR`): what a drafter folder is, and everything
that would stop vLLM from serving it or silently cost acceptance.

A folder's config.json is read once, by `peagle_jax.formats.head_config.head_facts` (the same facts the
importer validates), its tensors checked by the importer's `checkpoints.check_tensors` (headers,
plus the small d2t / t2d), and every float tensor read once, one at a time, for NaN / Inf. The
report lists `problems` (vLLM refuses the folder or serves it wrong: a missing tensor, which
vLLM's EAGLE-3 loader leaves at its random init; a shape; non-finite weights; d2t in a
full-vocabulary head; H != Ht; not 3 aux layers; a mask id outside the vocabulary; a speculators
fc_norm only the top level names; max_position_embeddings below the target's), `warnings`,
`notes`, `serve` (the vLLM command line, `serving.serve_command`) and `serve_lines` (what to run:
`serving.serve_lines`). The target is `target=DIR`, else the recorded verifier when it is on this
machine. With `vllm_version`, a head that release refuses (`engines.vllm_refusal`: vLLM 0.34 and
P-EAGLE) is a problem that names the release. Our own checkpoint is checked as the vLLM config
it exports to, its state restored for the NaN / Inf check.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from peagle_jax.config.drafter_config import DrafterConfig
from peagle_jax.config.target_config import NUM_AUX, ConfigError, read_json
from peagle_jax.formats.checkpoints import FLOAT_DTYPES, check_tensors
from peagle_jax.formats.engines import FIRST_PARALLEL, HEAD_KINDS, NEWEST_VLLM, serving_vllm, version_text, vllm_refusal
from peagle_jax.formats.finite import non_finite, non_finite_tensors
from peagle_jax.formats.head_config import (
    AUX_KEY,
    MASK_ID_KEYS,
    HeadFacts,
    drafter_config,
    head_facts,
    layer_windows,
    rope_params,
)
from peagle_jax.formats.head_config_write import speculators_config, vllm_config
from peagle_jax.formats.inspect_dflash import check_dflash, dflash_tensor_findings, serve_depth, settled_dflash
from peagle_jax.formats.inspect_report import format_report
from peagle_jax.formats.own import OWN_CONFIG_FILE, OWN_STATE_DIR, read_own
from peagle_jax.formats.serving import (
    resolve_verifier,
    serve_command,
    serve_lines,
    serve_note,
    target_facts,
    target_findings,
)
from peagle_jax.runtime.command_line import one_line
from peagle_jax.runtime.folders import CONFIG_FILE
from peagle_jax.sources.hub import is_repo_id, repo_id_of

__all__ = ["inspect_folder", "format_report", "InspectError"]


class InspectError(ValueError):
    """A folder that cannot be inspected at all (missing, not a head, an unusable target)."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Findings:
    """problems / warnings / notes, each message once."""

    def __init__(self):
        self.problems, self.warnings, self.notes = [], [], []

    def problem(self, msg: str) -> None:
        if msg not in self.problems:
            self.problems.append(msg)

    def warn(self, msg: str) -> None:
        if msg not in self.warnings:
            self.warnings.append(msg)

    def note(self, msg: str) -> None:
        if msg not in self.notes:
            self.notes.append(msg)


# ---------------------------------------------------------------------------------------
# entry point
def inspect_folder(
    path: str | os.PathLike, *, target: str | os.PathLike | None = None, display=None, vllm_version=None
) -> dict:
    """A report (dict) of a drafter folder: what it is, `problems`, `warnings`, `notes`, the
    `serve` command and `serve_lines`. `display`: the path to show instead of `path` (an export
    checks its temporary folder under the final name). `vllm_version` (major, minor): the vLLM
    release to check serving with (None: none in particular). InspectError / ConfigError when
    it is no head."""
    folder = Path(path)
    shown = Path(display) if display is not None else folder
    if not folder.exists():
        raise InspectError(f"{folder}: no such folder")
    if not folder.is_dir():
        raise InspectError(f"{folder}: not a folder")
    if (folder / OWN_CONFIG_FILE).exists():
        return _inspect_own(folder, shown, target, vllm_version)
    raw = read_json(folder / CONFIG_FILE)
    facts = head_facts(raw, str(shown / CONFIG_FILE))  # raises when the folder holds no head
    fnd = _Findings()
    ckpt = _open_checkpoint(folder, shown, fnd)
    keys = set() if ckpt is None else set(ckpt.keys())
    mode = facts.mode or ("parallel" if facts.mask_ids or "mask_hidden" in keys else "chain")
    report = _report(folder, shown, raw, facts, mode, target, fnd, vllm_version)
    files = sorted(p.name for p in folder.iterdir() if p.name.endswith(".safetensors"))
    report.update(files=files, tensors=len(keys), bytes=sum((folder / f).stat().st_size for f in files))
    if ckpt is not None:
        cfg = _tensor_config(facts, mode, fnd)
        _check_tensors(ckpt, cfg, mode, fnd, report, lambda text: text.replace(str(folder), str(shown)))
    return {**report, "problems": fnd.problems, "warnings": fnd.warnings, "notes": fnd.notes}


def _inspect_own(folder: Path, shown: Path, target, vllm_version) -> dict:
    """Our checkpoint, checked as the config.json it exports to (no tensors: orbax state)."""
    try:
        meta = json.loads((folder / OWN_CONFIG_FILE).read_text())
        cfg = DrafterConfig.from_dict(meta.get("config") or {}, f"{shown / OWN_CONFIG_FILE} key 'config'")
    except ConfigError:
        raise
    except (OSError, ValueError, AttributeError) as err:
        raise InspectError(f"{shown / OWN_CONFIG_FILE}: {err}") from None
    raw = speculators_config(cfg) if cfg.qk_norm else vllm_config(cfg)
    fnd = _Findings()
    if not (folder / OWN_STATE_DIR).is_dir():
        fnd.problem(f"{shown / OWN_STATE_DIR}: missing (our checkpoint holds drafter.json and state/)")
    else:
        _check_own_finite(folder, shown, fnd)
    if cfg.dummy_target:
        fnd.warn(
            f"{shown / OWN_CONFIG_FILE}: made for a target with dummy (random) weights (key 'config': "
            "'dummy_target': true): for speed and memory runs only, its drafts are meaningless"
        )
    facts = head_facts(raw, str(shown / OWN_CONFIG_FILE))
    report = _report(folder, shown, raw, facts, cfg.mode, target, fnd, vllm_version, own=True)
    report.update(format="own", architecture=None, speculators_model_type=None, dtype=meta.get("dtype"), serve=None)
    report.update(serve_lines=[], serve_note=None)
    return {**report, "problems": fnd.problems, "warnings": fnd.warnings, "notes": fnd.notes}


def _report(
    folder: Path, shown: Path, raw: dict, facts: HeadFacts, mode: str, target, fnd: _Findings, vllm_version, own=False
) -> dict:
    """What the config says, its findings and the target's (tensor fields left empty)."""
    h, v = facts.sizes["hidden_size"], facts.sizes["vocab_size"]
    report = {
        "path": str(shown),
        "format": facts.fmt,
        "architecture": facts.kind if facts.fmt == "vllm" else raw.get("architectures"),
        "speculators_model_type": facts.kind if facts.fmt == "speculators" else None,
        "mode": mode,
        "block_size": facts.block_size,
        "num_layers": facts.sizes["num_hidden_layers"],
        "hidden_size": h,
        "target_hidden_size": facts.target_hidden_size or h,
        "vocab_size": v,
        "draft_vocab_size": facts.draft_vocab_size or v,
        "mask_token_id": facts.mask_id,
        "mask_token_keys": [] if own else sorted(facts.mask_ids),
        "aux_layer_ids": facts.aux,
        "k_hints": {"k_train": facts.k_train} if own and facts.k_train else facts.k_hints,
        "norm_before_residual": facts.norm_before_residual,
        "max_position_embeddings": facts.layer.get("max_position_embeddings"),
        **_rope(facts),
        **_windows(facts, fnd),
        "layer0_prefix": None,
        "tensors": None,
        "files": [],
        "bytes": None,
        "dtype": None,
        "target": None,
        "target_family": facts.target_family,
        "vllm_version": None if vllm_version is None else version_text(vllm_version),
    }
    aux_ok = _check_config(facts, raw, mode, fnd, own)
    _check_target(fnd, report, folder, target, facts.verifier, facts.aux if aux_ok else None)
    if mode == "chain":
        fnd.note("EAGLE-3 chain head (no parallel drafting): serve without parallel_drafting")
    if vllm_version is not None:
        _check_release(vllm_version, mode, "vllm" if own else facts.fmt, fnd)
    report["serve"], report["serve_lines"] = _serve(report, facts)
    report["serve_note"] = serve_note(mode)
    return report


def _check_release(version: tuple[int, int], mode: str, fmt: str, fnd: _Findings) -> None:
    """What vLLM release `version` makes of the head kind (`engines.vllm_refusal`)."""
    v = version_text(version)
    refusal = vllm_refusal(version, mode, fmt)
    if refusal is not None:
        plain = " (exported --as eagle3 it loads, and drafts one token at a time)" if version >= FIRST_PARALLEL else ""
        fnd.problem(
            f"vLLM {v} refuses {HEAD_KINDS[mode]} heads: {refusal}{plain}; serve it with {serving_vllm(mode)}, "
            "or with this project's server (python -m infer serve)"
        )
    elif version > NEWEST_VLLM:
        fnd.note(
            f"vLLM {v} is newer than the releases this lint was checked against (up to "
            f"{version_text(NEWEST_VLLM)}): what it serves is taken to be as in {version_text(NEWEST_VLLM)}"
        )


def _serve(report: dict, facts: HeadFacts) -> tuple[str, list[str]]:
    """The vLLM command line for the folder and the lines to serve it (`serving.serve_lines`):
    K from the recorded trained depth (else the largest hint); the target checked against (its
    Hub id when it is a snapshot of the cache), else a hub-id verifier."""
    hints = [x for x in facts.k_hints.values() if _is_int(x)]
    k = facts.k_train if facts.k_train is not None else max(hints, default=None)
    if report["mode"] == "dflash":
        k = serve_depth(facts)
    if report["target"] is not None:  # a snapshot of the Hub cache is served by its id
        target = repo_id_of(report["target"]["path"]) or report["target"]["path"]
    else:
        target = facts.verifier if is_repo_id(facts.verifier, bare=True) else "TARGET"
    args = (report["path"], report["mode"], k, report["target_family"], target)
    return serve_command(*args), serve_lines(*args)


def _rope(facts: HeadFacts) -> dict:
    """The report's rope fields: `rope_type` and `rope`, a one-line summary."""
    try:
        params = rope_params(facts.layer, facts.layer_where)
    except ConfigError:
        return {"rope_type": None, "rope": "invalid"}
    kind = params.get("rope_type", params.get("type", "default"))
    extra = {k: v for k, v in params.items() if k not in ("rope_type", "type")}
    return {"rope_type": kind, "rope": f"{kind} " + ", ".join(f"{k}={v}" for k, v in sorted(extra.items()))}


def _windows(f: HeadFacts, fnd: _Findings) -> dict:
    """The report's `sliding_layers` (drafter layers with a window) and `sliding_window`. A
    malformed window is a problem; a window shorter than the trained depth K a warning
    (training and vLLM then disagree on the deepest rows)."""
    try:
        types, window = layer_windows(f.layer, f.layer_where, f.sizes["num_hidden_layers"])
    except ConfigError as err:
        fnd.problem(str(err))
        return {"sliding_layers": None, "sliding_window": None}
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    hints = [x for x in f.k_hints.values() if _is_int(x)]
    k = f.k_train if _is_int(f.k_train) else max(hints, default=None)
    if sliding:
        fnd.note(
            f"drafter layers {sliding} attend within a sliding window of {window} tokens (layer_types / "
            "sliding_window, which vLLM applies per draft layer)"
        )
    if sliding and k is not None and k > window:
        fnd.warn(
            f"sliding_window {window} < trained depth K {k}: training lets a row see its whole chain, but "
            f"vLLM's positional window hides chain rows {window} or more positions back, so drafts at depth "
            f">= {window} differ from training; serve with num_speculative_tokens <= {window}"
        )
    return {"sliding_layers": sliding, "sliding_window": window}


def _open_checkpoint(folder: Path, shown: Path, fnd: _Findings):
    from peagle_jax.sources.weights import Checkpoint, WeightsError

    try:
        return Checkpoint(folder)
    except WeightsError as err:
        fnd.problem(str(err).replace(str(folder), str(shown)))
        return None


# ---------------------------------------------------------------------------------------
# config
def _check_config(f: HeadFacts, raw: dict, mode: str, fnd: _Findings, own: bool) -> bool:
    """Problems and warnings of the config's facts; True when the aux ids are usable. `own`: the
    config an own checkpoint exports to (its verifier is set on export)."""
    h, v = f.sizes["hidden_size"], f.sizes["vocab_size"]
    vd, ht = f.draft_vocab_size or v, f.target_hidden_size or h
    if f.fmt == "speculators" and "model_type" in raw:
        fnd.warn(
            f"top-level key 'model_type' ({raw['model_type']!r}) in a speculators config: vLLM may take it for "
            "a plain model config; speculators configs have none"
        )
    for msg in f.conflicts():
        fnd.problem(msg)
    if _is_int(vd) and vd > v:
        fnd.problem(f"draft_vocab_size {vd} > vocab_size {v}")
    if not _is_int(ht) or ht != h:
        fnd.problem(
            f"hidden_size {h} != target_hidden_size {ht}: vLLM's EAGLE-3 / P-EAGLE heads need the drafter "
            "hidden size to equal the target's"
        )
    if mode == "parallel":
        _check_mask_id(f, v, fnd)
    if f.use_aux_hidden_state is False:
        fnd.problem("eagle_config.use_aux_hidden_state is false: an EAGLE-1 head, not EAGLE-3 / P-EAGLE")
    if raw.get("tie_word_embeddings") or f.layer.get("tie_word_embeddings"):
        fnd.warn("tie_word_embeddings is true: drafter heads keep a separate lm_head [Vd, H]")
    if f.fmt == "speculators" and not own:
        _check_speculators(f, fnd)
    return check_dflash(f, fnd) if mode == "dflash" else _check_aux(f, fnd)


def _check_aux(f: HeadFacts, fnd: _Findings) -> bool:
    aux = f.aux
    if len(set(map(str, f.aux_ids.values()))) > 1:
        return False  # a conflict, reported
    if aux is None:
        fnd.warn(
            f"no {AUX_KEY}: vLLM falls back to (2, L//2, L-3) of the target; make sure the head was trained on "
            "those layers"
        )
        return False
    if not isinstance(aux, list) or not all(_is_int(i) for i in aux):
        fnd.problem(f"{AUX_KEY} {aux!r} is not a list of layer ids")
        return False
    if len(aux) != NUM_AUX:
        fnd.problem(
            f"{AUX_KEY} lists {len(aux)} layers {aux}; vLLM's EAGLE-3 heads use exactly {NUM_AUX} aux layers "
            "(fc reads 3 * target_hidden_size)"
        )
        return False
    if len(set(aux)) != NUM_AUX or aux != sorted(aux) or min(aux) < 0:
        fnd.problem(f"{AUX_KEY} {aux} must be 3 distinct non-negative ids in layer order")
    if f.fmt == "vllm" and AUX_KEY not in f.aux_ids:
        fnd.warn(f"{AUX_KEY} only inside eagle_config: older vLLM releases read the top-level key")
    return True


def _check_mask_id(f: HeadFacts, v: int, fnd: _Findings) -> None:
    ids, mask_id = f.mask_ids, f.mask_id
    if mask_id is None:
        keys_txt = "mask_token_id" if f.fmt == "speculators" else "/".join(MASK_ID_KEYS)
        fnd.problem(f"no mask token id ({keys_txt}): a parallel (P-EAGLE) head needs one for parallel_drafting")
    elif len({str(x) for x in ids.values()}) > 1:
        return  # a conflict, reported
    elif not _is_int(mask_id) or not 0 <= mask_id < v:
        fnd.problem(f"mask token id {mask_id!r} ({', '.join(sorted(ids))}) outside the vocabulary [0, {v})")
    elif f.fmt == "vllm" and len(ids) < len(MASK_ID_KEYS):
        missing = [k for k in MASK_ID_KEYS if k not in ids]
        fnd.warn(f"mask token id only under {sorted(ids)}, not {missing}: different vLLM releases read different keys")


def _check_speculators(f: HeadFacts, fnd: _Findings) -> None:
    for name, places in f.layer_flags.items():
        if places.get("top") is True and "layer" not in places:
            fnd.problem(
                f"{name!r} is true only at the top level: vLLM builds the head from transformer_layer_config "
                f"and its speculators translation (peagle; eagle3 in older releases) drops the top-level key, so "
                f"the head loads without {name} (write it inside transformer_layer_config too)"
            )
    if f.verifier is None:
        fnd.note(
            "no verifier.name_or_path: `vllm serve` of this folder alone cannot find the target (the serve "
            "command's --speculative-config form does not need it)"
        )
    elif not is_repo_id(f.verifier, bare=True):
        fnd.warn(
            f"verifier.name_or_path {f.verifier!r} is a local path: `vllm serve` of this folder alone wants a "
            "hub id (export --verifier ORG/NAME)"
        )


def _tensor_config(f: HeadFacts, mode: str, fnd: _Findings) -> DrafterConfig | None:
    """The DrafterConfig whose tensor table the folder must hold, with the problems already
    reported (aux ids, mask id, conflicts) settled so that the shape checks still run."""
    v = f.sizes["vocab_size"]
    mask = f.mask_id if _is_int(f.mask_id) and 0 <= f.mask_id < v else 0
    vd = f.draft_vocab_size
    if mode == "dflash":
        f = settled_dflash(f)
        if f is None:  # no usable context layers (reported): fc's width is unknown
            return None
    settled = dataclasses.replace(
        f,
        mode=mode,
        aux_ids=f.aux_ids if mode == "dflash" else {},
        mask_ids=f.mask_ids if mode == "dflash" else ({"mask_token_id": mask} if mode == "parallel" else {}),
        draft_vocab_size=min(vd, v) if _is_int(vd) else vd,
        use_aux_hidden_state=None,
        layer_flags={n: {"layer": f.flag(n)} for n in f.layer_flags},
    )
    try:
        return drafter_config(settled)
    except ConfigError as err:
        fnd.problem(str(err))
        return None


# ---------------------------------------------------------------------------------------
# tensors
def _check_tensors(ckpt, cfg: DrafterConfig | None, mode: str, fnd: _Findings, report: dict, shown_as) -> None:
    """The importer's tensor check (`checkpoints.check_tensors`), every finding reported, plus
    what vLLM needs beyond it. `shown_as`: a message with the folder under its shown name."""
    keys = set(ckpt.keys())
    if any(k.startswith("midlayer.") for k in keys):
        report["layer0_prefix"] = "midlayer."
        if report["format"] == "speculators":
            fnd.warn("'midlayer.*' tensors in a speculators folder: speculators names layer 0 'layers.0.*'")
    elif any(k.startswith("layers.0.") for k in keys):
        report["layer0_prefix"] = "layers.0."
    dtypes = sorted({ckpt.dtype(k) for k in keys if k not in ("d2t", "t2d")})
    report["dtype"] = ",".join(dtypes) if dtypes else None
    if mode == "parallel" and "mask_hidden" not in keys:
        fnd.problem(
            "missing tensor 'mask_hidden' [1, 1, 3*Ht]: vLLM raises when parallel_drafting is on (and "
            "speculators' from_pretrained silently fills it with random values)"
        )
    if "embed_tokens.weight" not in keys and mode == "parallel":
        fnd.problem(
            "missing tensor 'embed_tokens.weight': vLLM would share the target's embeddings, whose "
            "mask-token row was never trained"
        )
    elif mode == "dflash":
        dflash_tensor_findings(keys, report["draft_vocab_size"] == report["vocab_size"], fnd)
    elif "embed_tokens.weight" not in keys:
        fnd.warn(
            "no 'embed_tokens.weight': vLLM shares the target's embeddings (fine for an EAGLE-3 head trained "
            "with frozen embeddings)"
        )
    if cfg is not None:
        _check_table(ckpt, cfg, keys, fnd, shown_as)
    _check_finite(ckpt, fnd, shown_as)


def _check_finite(ckpt, fnd: _Findings, shown_as) -> None:
    """Every float tensor of `ckpt` read once: NaN / Inf weights are a problem (vLLM loads them and
    drafts from NaN logits)."""
    from peagle_jax.sources.weights import WeightsError

    for name in sorted(k for k in ckpt.keys() if ckpt.dtype(k) in FLOAT_DTYPES):
        try:
            found = non_finite(ckpt.read(name))
        except WeightsError as err:
            fnd.problem(shown_as(str(err)))
            continue
        if found:
            fnd.problem(shown_as(f"{ckpt.where[name]}: tensor {name!r} holds {found}"))


def _check_own_finite(folder: Path, shown: Path, fnd: _Findings) -> None:
    """Our checkpoint's state restored (what export and load_drafter read): NaN / Inf weights, or
    a state that cannot be restored, are problems."""
    state = shown / OWN_STATE_DIR
    try:
        _, arrays, _ = read_own(folder)
    except (OSError, ValueError) as err:
        return fnd.problem(one_line(err).replace(str(folder), str(shown)))
    for name, found in non_finite_tensors(arrays):
        fnd.problem(f"{state}: tensor {name!r} holds {found}")


def _check_table(ckpt, cfg: DrafterConfig, keys: set, fnd: _Findings, shown_as) -> None:
    chk = check_tensors(ckpt, cfg)
    for msg in chk.errors:
        fnd.problem(shown_as(msg))
    for name in chk.reshaped:
        fnd.warn(
            shown_as(
                f"{ckpt.where[name]}: tensor {name!r} has shape {list(ckpt.shape(name))}; vLLM expects "
                f"{[1, 1, cfg.fc_in]}"
            )
        )
    for name, want in chk.missing.items():
        if name == "d2t":
            fnd.problem(
                f"missing tensor 'd2t' [{cfg.draft_vocab_size}] (int64): draft vocab {cfg.draft_vocab_size} < "
                f"vocab {cfg.vocab_size} needs the id map"
            )
        elif name not in ("embed_tokens.weight", "mask_hidden"):  # reported above
            fnd.problem(f"missing tensor {name!r} (expected shape {list(want)}): vLLM would keep its random init")
    maps = sorted({"d2t", "t2d"} & keys)
    if maps and cfg.draft_vocab_size == cfg.vocab_size:
        fnd.problem(
            f"tensor(s) {maps} in a full-vocabulary head (draft_vocab_size == vocab_size): vLLM (0.33, "
            f"{version_text(NEWEST_VLLM)}) creates no draft_id_to_target_id parameter then and refuses the checkpoint"
        )
    if chk.extra:
        fnd.problem(
            f"unexpected tensor(s) {chk.extra[:5]}{' ...' if len(chk.extra) > 5 else ''} for this config "
            f"({cfg.num_layers} layers, mode {cfg.mode}); vLLM cannot load them"
        )


# ---------------------------------------------------------------------------------------
# target
def _check_target(fnd: _Findings, report: dict, folder: Path, target_arg, verifier, aux) -> None:
    """The head against its target: `target_arg`, else the recorded verifier when it is here."""
    if target_arg is not None:
        tfolder = Path(target_arg)
        if not tfolder.is_dir():
            raise InspectError(f"{tfolder}: no such target folder")
        t = target_facts(tfolder)
    else:
        tfolder = resolve_verifier(verifier, folder)
        if tfolder is None:
            if verifier:
                fnd.note(
                    f"target {verifier!r} not found on this machine (pass --target DIR to check the head against it)"
                )
            return
        try:
            t = target_facts(tfolder)
        except ConfigError as err:
            return fnd.note(f"recorded target not usable for checks: {err}")
    report["target"] = t
    report["target_family"] = t["family"] or report["target_family"]
    fields = ("target_hidden_size", "vocab_size", "max_position_embeddings", "rope_type")
    problems, notes = target_findings(t, aux_layer_ids=aux, **{k: report[k] for k in fields})
    if report["aux_layer_ids"] is None and report["mode"] != "dflash":
        n = t["num_layers"]
        notes.insert(0, f"vLLM will use the default aux layers {[2, n // 2, n - 3]} of this {n}-layer target")
    for msg in problems:
        fnd.problem(msg)
    for msg in notes:
        fnd.note(msg)
