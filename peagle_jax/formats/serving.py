"""How a drafter head is served: the command lines, and the target it runs beside.

`serve_command` builds the vLLM command line: `--speculative-config '{"method": "eagle3",
"model": DIR, ...}'` for both head formats, `parallel_drafting` for P-EAGLE heads, K capped at
`SERVE_K` (DFlash heads: `"method": "dflash"`, K = block_size - 1), and `--model-impl
transformers` for target families whose native vLLM model captures no aux hidden states.
`serve_lines` is the one builder of what the converter, the lint and the trainer print: that
command (for a P-EAGLE head pinned to the vLLM releases that serve it, `engines`) and this
project's server on the same folder. `target_facts` reads what the checks need from a target
folder's config.json (any family, multimodal too; a head's folder is refused), `target_findings`
is what stops a head from serving beside that target, and `resolve_verifier` finds a head's
recorded target on this machine (a Hub id: in the cache).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from peagle_jax.config.target_config import ConfigError, read_json
from peagle_jax.formats.engines import HEAD_KINDS, NEWEST_VLLM, serving_vllm, version_text
from peagle_jax.formats.head_config import AUX_KEY, refuse_head, rope_params
from peagle_jax.models.registry import ARCHITECTURES, MODEL_TYPES, VLLM_EAGLE3_NATIVE
from peagle_jax.sources.hub import cached

__all__ = [
    "SERVE_K",
    "serve_k",
    "serve_command",
    "serve_lines",
    "serve_note",
    "target_facts",
    "target_findings",
    "resolve_verifier",
    "aux_capture",
]

# The served depth when the head allows it: P-EAGLE's published GPT-OSS results peak at K=7
# (EAGLE-3 at K=3), and the released heads are served at 5-7 (K_infer <= K_train).
SERVE_K = 7
_TARGET_SIZES = (
    ("num_hidden_layers", "num_layers"),
    ("hidden_size", "hidden_size"),
    ("vocab_size", "vocab_size"),
    ("max_position_embeddings", "max_position_embeddings"),
)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def serve_k(k_train=None) -> int:
    """num_speculative_tokens to serve a head with: its trained depth, capped at SERVE_K."""
    return min(k_train, SERVE_K) if _is_int(k_train) and k_train > 0 else SERVE_K


def aux_capture(family: str | None) -> bool:
    """Whether vLLM's native model of a target family captures aux hidden states (unknown: yes)."""
    return VLLM_EAGLE3_NATIVE.get(family, True)


def serve_command(model, mode: str, k_train=None, target_family: str | None = None, target: str = "TARGET") -> str:
    """`vllm serve TARGET --speculative-config '{...}'` for a head folder of either format: method
    eagle3 (a speculators folder given without it becomes a plain draft model, no parallel
    drafting), K = `serve_k(k_train)`, `parallel_drafting` for a parallel (P-EAGLE) head. A DFlash
    head (mode "dflash"): method dflash, K = `k_train` as given (its block_size - 1: one pass
    drafts the whole block, so the SERVE_K cap does not apply)."""
    if mode == "dflash":
        spec: dict[str, Any] = {"method": "dflash", "model": str(model), "num_speculative_tokens": k_train}
    else:
        spec = {"method": "eagle3", "model": str(model), "num_speculative_tokens": serve_k(k_train)}
    if mode == "parallel":
        spec["parallel_drafting"] = True
    cmd = f"vllm serve {target} --speculative-config '{json.dumps(spec)}'"
    return cmd if aux_capture(target_family) else cmd + " --model-impl transformers"


def serve_lines(model, mode: str, k_train=None, target_family: str | None = None, target: str = "TARGET") -> list[str]:
    """What to run to serve a head folder: the vLLM command (`serve_command`; a P-EAGLE head's
    pinned to the releases that serve it, `pip install "vllm>=0.16,<0.34" && vllm serve ...`),
    then this project's OpenAI-compatible server on the same folder (`python -m infer serve`)."""
    vllm = serve_command(model, mode, k_train, target_family, target)
    pin = serving_vllm(mode)
    if pin != "vllm":
        vllm = f"pip install {json.dumps(pin)} && {vllm}"
    k = k_train if mode == "dflash" else serve_k(k_train)
    return [vllm, f"python -m infer serve --target {target} --drafter {model} --k {k}"]


def serve_note(mode: str) -> str | None:
    """The line printed before `serve_lines` when current vLLM does not serve the head kind."""
    if serving_vllm(mode) == "vllm":
        return None
    return (
        f"vLLM {version_text(NEWEST_VLLM)} and later refuse {HEAD_KINDS[mode]} heads (the V1 runner and parallel "
        f"drafting for eagle3 were removed): serve this head with {serving_vllm(mode)}, or with this project's "
        "server (python -m infer serve)"
    )


def resolve_verifier(name, folder: str | os.PathLike) -> Path | None:
    """The target folder a head's recorded verifier names on this machine: relative to the
    head's folder, then to the working directory, then a Hub id's snapshot in the Hugging Face
    cache (no request is made). None when it is not here."""
    if not name or not isinstance(name, str):
        return None
    cands = [Path(name)] if Path(name).is_absolute() else [Path(folder) / name, Path.cwd() / name]
    return next((c.resolve() for c in cands if (c / "config.json").is_file()), None) or cached(name)


def target_facts(folder: str | os.PathLike) -> dict:
    """path, model_type, architectures, family, num_layers, hidden_size, vocab_size,
    max_position_embeddings, rope_type of a target folder. ConfigError naming the file and key
    when a size is missing or not an int."""
    refuse_head(folder)
    cfg_file = Path(folder) / "config.json"
    raw = read_json(cfg_file)
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    archs = raw.get("architectures") or []
    family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if family is None and raw.get("model_type") in MODEL_TYPES:
        family = MODEL_TYPES[raw["model_type"]].name
    info = {"path": str(folder), "model_type": raw.get("model_type"), "architectures": archs, "family": family}
    for key, name in _TARGET_SIZES:
        value = text.get(key, raw.get(key))
        if not _is_int(value):
            raise ConfigError(f"{cfg_file}: missing or invalid key {key!r}")
        info[name] = value
    try:
        params = rope_params(text, str(cfg_file))
        info["rope_type"] = params.get("rope_type", params.get("type", "default"))
    except ConfigError:
        info["rope_type"] = None
    return info


def target_findings(
    t: dict, *, target_hidden_size, vocab_size, aux_layer_ids, max_position_embeddings, rope_type
) -> tuple[list[str], list[str]]:
    """(problems, notes) of serving a head with these fields beside the target `t` (`target_facts`).
    `aux_layer_ids`: the head's ids when usable, else None (not checked)."""
    problems, notes, where, n = [], [], t["path"], t["num_layers"]
    if _is_int(target_hidden_size) and t["hidden_size"] != target_hidden_size:
        problems.append(
            f"target_hidden_size {target_hidden_size} != the target's hidden_size {t['hidden_size']} ({where})"
        )
    if t["vocab_size"] != vocab_size:
        problems.append(f"vocab_size {vocab_size} != the target's vocab_size {t['vocab_size']} ({where})")
    if aux_layer_ids is not None and any(not 0 <= i < n for i in aux_layer_ids):
        problems.append(f"{AUX_KEY} {list(aux_layer_ids)} outside the target's {n} layers [0, {n})")
    if not _is_int(max_position_embeddings):
        problems.append("no max_position_embeddings in the drafter config")
    elif max_position_embeddings < t["max_position_embeddings"]:
        problems.append(
            f"max_position_embeddings {max_position_embeddings} < the target's {t['max_position_embeddings']} "
            f"({where}): vLLM refuses or stops speculating past the drafter's limit"
        )
    if t["rope_type"] is not None and rope_type and t["rope_type"] != rope_type:
        notes.append(
            f"drafter rope '{rope_type}' differs from the target's '{t['rope_type']}' (deliberate for the AWS "
            "GPT-OSS heads: llama3 on a YaRN target; check it matches training)"
        )
    if not aux_capture(t["family"]):
        notes.append(
            f"vLLM's native {t['family']} model does not capture aux hidden states (no SupportsEagle3, in 0.33 and "
            f"{version_text(NEWEST_VLLM)}): serve the target with --model-impl transformers (the serve command adds it)"
        )
    return problems, notes
