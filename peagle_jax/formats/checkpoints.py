"""Drafter checkpoint formats on (DrafterConfig, {path: array}) (docs/method.md section 6).

Our own checkpoint (`drafter.json` + orbax `state/`) and two layouts of other tools, both
`config.json` + `model.safetensors` (or a sharded index) with flat keys:
- vLLM native (`architectures: ["LlamaForCausalLMEagle3"]`, model_type llama): layer 0 as
  `midlayer.*` (or `layers.0.*`), later layers `layers.{i}.*`; the mask id under
  `mask_token_id` / `pard_token` / `ptd_token_id`; aux ids top level or in `eagle_config`.
- speculators (`speculators_model_type: "peagle"` or `"eagle3"`): the layer shape in
  `transformer_layer_config`, weights under `layers.{i}.*`.
- DFlash heads (mode "dflash") in both: vLLM native / z-lab `DFlashDraftModel` (every tensor,
  embed_tokens and lm_head included) and speculators "dflash" (as `DFlashDraftModel.save_pretrained`
  writes it: no embed_tokens, lm_head only with a draft vocabulary). Tensors: fc.weight [H, n*Ht]
  (n context layers), hidden_norm.weight [H], layers.{i}.* with q/k norms, norm, lm_head, d2t / t2d.
  A missing embed_tokens / lm_head comes from the target (`read_drafter(target_weights=...)`).
Their config.json files are read by `peagle_jax.formats.head_config` (DFlash keys:
`peagle_jax.formats.head_config_dflash`) and written by `peagle_jax.formats.head_config_write` (both re-exported
here). Our own checkpoint format is `peagle_jax.formats.own` (re-exported here too).

Tensor names (PyTorch [out, in]): embed_tokens.weight [V, H], fc.weight [H, 3Ht],
input_norm.weight [3Ht] (norm_before_fc), fc_norm.{0,1,2}.weight [Ht] (fc_norm),
layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H],
layers.{i}.self_attn.{q,k,v}_proj.weight [heads*hd, 2H (layer 0) | H] (+ .bias with
attention_bias, o_proj too), layers.{i}.self_attn.{q,k}_norm.weight [hd] (qk_norm),
layers.{i}.mlp.{gate,up,down}_proj.weight, norm.weight [H], lm_head.weight [Vd, H],
d2t [Vd] int64 and t2d [V] bool (only when Vd < V), mask_hidden [1, 1, 3Ht] (parallel heads).

Import checks every key, shape and dtype (`check_tensors`, shared with the lint): errors
(`DrafterIOError`, `ConfigError`) name the file and the key; float tensors keep the file's dtype
(a bf16 file stays bf16 in host memory). Export writes bf16 by default (d2t int64, t2d bool)
into a temporary sibling folder renamed into place. Where the tools differ, vLLM decides:
- o_proj carries a bias whenever `attention_bias` is set (Hugging Face and vLLM Llama).
- A full-vocabulary head (Vd == V) carries no d2t/t2d: vLLM (0.33, 0.34) then creates no
  `draft_id_to_target_id` parameter and refuses a checkpoint that has one. A reduced head must.
- `norm_output` (EAGLE 3.1): chain mode feeds the post-norm state back (`DrafterModel.feedback`).
- Sliding-window layers: `layer_types`, `sliding_window` and `use_sliding_window` in the layer
  config (`transformer_layer_config`; the top level of a vLLM-native config), as speculators
  writes them and vLLM reads them (`head_config.layer_windows`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np

from peagle_jax.config.drafter_config import DrafterConfig
from peagle_jax.config.dtypes import EXPORT, numpy_dtype
from peagle_jax.config.target_config import NUM_AUX, ConfigError, default_aux_layer_ids, read_json
from peagle_jax.formats.head_config import head_facts, read_speculators_config, read_vllm_config
from peagle_jax.formats.head_config_write import speculators_config, vllm_config
from peagle_jax.formats.own import OWN_CONFIG_FILE, read_own, read_own_config
from peagle_jax.formats.serving import resolve_verifier, target_facts
from peagle_jax.models.eagle import abstract_drafter, check_d2t, flat_state, t2d_from_d2t
from peagle_jax.runtime.folders import CONFIG_FILE, SINGLE_FILE, write_hf_folder

__all__ = [
    "DrafterIOError",
    "detect_format",
    "read_drafter",
    "read_drafter_config",
    "key_map",
    "checkpoint_key",
    "checkpoint_shape",
    "read_id_map",
    "check_tensors",
    "TensorCheck",
    "checkpoint_tensors",
    "vllm_tensors",
    "speculators_tensors",
    "export_vllm",
    "export_speculators",
]

LAYER0, MIDLAYER = "layers.0.", "midlayer."
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # safetensors header names
TARGET_SHARED = ("embed_tokens.weight", "lm_head.weight")  # a DFlash head may take them from the target


class DrafterIOError(ValueError):
    """A drafter folder that cannot be used; the message names the file and key."""


# ---------------------------------------------------------------------------------------
# key table
def key_map(cfg: DrafterConfig) -> list[tuple[str, tuple, str]]:
    """(checkpoint key with layer 0 as `layers.0.`, our state path, transform) per tensor.

    transform: "linear" (transpose), "identity", "d2t" (int offsets), "mask" (mask_hidden).
    The d2t row is there for every head (our state holds it); its tensor only when Vd < V.
    """
    rows: list[tuple[str, tuple, str]] = [
        ("embed_tokens.weight", ("embed_tokens", "embedding"), "identity"),
        ("fc.weight", ("fc", "kernel"), "linear"),
    ]
    dflash = cfg.mode == "dflash"
    if dflash:  # the context norm after fc (EAGLE-3 heads have theirs in layer 0)
        rows.append(("hidden_norm.weight", ("hidden_norm", "weight"), "identity"))
    if cfg.norm_before_fc:
        rows.append(("input_norm.weight", ("input_norm", "weight"), "identity"))
    if cfg.fc_norm:
        rows += [(f"fc_norm.{j}.weight", ("fc_norm", j, "weight"), "identity") for j in range(NUM_AUX)]
    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        norms = ["input_layernorm", "post_attention_layernorm"] + (["hidden_norm"] if i == 0 and not dflash else [])
        rows += [(f"{pre}{n}.weight", ("layers", i, n, "weight"), "identity") for n in norms]
        for p in "qkvo":
            proj = ("layers", i, "self_attn", f"{p}_proj")
            rows.append((f"{pre}self_attn.{p}_proj.weight", proj + ("kernel",), "linear"))
            if cfg.attention_bias:
                rows.append((f"{pre}self_attn.{p}_proj.bias", proj + ("bias",), "identity"))
        if cfg.qk_norm:
            rows += [
                (f"{pre}self_attn.{n}.weight", ("layers", i, "self_attn", n, "weight"), "identity")
                for n in ("q_norm", "k_norm")
            ]
        rows += [
            (f"{pre}mlp.{p}_proj.weight", ("layers", i, "mlp", f"{p}_proj", "kernel"), "linear")
            for p in ("gate", "up", "down")
        ]
    rows += [
        ("norm.weight", ("norm", "weight"), "identity"),
        ("lm_head.weight", ("lm_head", "kernel"), "linear"),
        ("d2t", ("d2t",), "d2t"),
    ]
    if cfg.mode == "parallel":
        rows.append(("mask_hidden", ("mask_hidden",), "mask"))
    return rows


def checkpoint_key(key: str, layer0: str) -> str:
    """A key_map key with layer 0 named `layer0` ("layers.0." or "midlayer.")."""
    return layer0 + key[len(LAYER0) :] if key.startswith(LAYER0) else key


def checkpoint_shape(our_shape: tuple, transform: str) -> tuple:
    """The checkpoint ([out, in]) shape of one of our variables."""
    return tuple(reversed(our_shape)) if transform == "linear" else tuple(our_shape)


def _needs_tensor(cfg: DrafterConfig, key: str) -> bool:
    """Whether a checkpoint must hold `key`: d2t only for a draft vocabulary; a DFlash head
    may leave its embed_tokens (always) and a full-vocabulary lm_head to the target's, as vLLM
    and speculators do."""
    reduced = cfg.draft_vocab_size < cfg.vocab_size
    if cfg.mode == "dflash" and key in TARGET_SHARED:
        return key == "lm_head.weight" and reduced
    return key != "d2t" or reduced


# ---------------------------------------------------------------------------------------
# import
def detect_format(path: str | os.PathLike) -> str:
    """ "own" (drafter.json), "speculators" or "vllm" (config.json)."""
    p = Path(path)
    if (p / OWN_CONFIG_FILE).exists():
        return "own"
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such folder")
    return head_facts(read_json(p / CONFIG_FILE), str(p / CONFIG_FILE)).fmt  # raises on a non-head


def _checkpoint(folder: Path):
    from peagle_jax.sources.weights import Checkpoint, WeightsError

    try:
        return Checkpoint(folder)
    except WeightsError as err:
        raise DrafterIOError(str(err)) from None


def _read(ckpt, key: str) -> np.ndarray:
    try:
        return np.asarray(ckpt.read(key))
    except Exception as err:
        raise DrafterIOError(str(err)) from None


def read_drafter(path: str | os.PathLike, *, embeddings=None, target_weights=None) -> tuple[DrafterConfig, dict, str]:
    """(config, {path: array}, dtype) of a drafter folder in any format: our checkpoint,
    vLLM-native or speculators. dtype: the one a handle should hold the arrays in (our
    checkpoint: as saved; imports: "float32", exact for bf16 / f16 files); imported float
    arrays keep the file's dtype. `embeddings`: a callable giving the target's [V, H] input
    embeddings, used only for a head that ships no embed_tokens (an EAGLE-3 chain head; a
    DFlash head when `target_weights` is not given). `target_weights`: a callable giving the
    target's stored (embedding [V, H] without Gemma's scale, lm_head [V, H]), what a DFlash head
    that ships no embed_tokens / lm_head takes (speculators saves neither for a full vocabulary;
    a draft vocabulary's lm_head rows are the target's at d2t)."""
    folder = Path(path)
    if detect_format(folder) == "own":
        return read_own(folder)
    config = read_drafter_config(folder)
    return config, _read_tensors(folder, config, TargetSource(embeddings, target_weights)), "float32"


def read_drafter_config(path: str | os.PathLike) -> DrafterConfig:
    """The DrafterConfig of a drafter folder in any format (`read_drafter`'s), no tensor read:
    its shapes, mode and draft vocabulary size before the weights are loaded."""
    folder = Path(path)
    fmt = detect_format(folder)
    if fmt == "own":
        return read_own_config(folder)[0]
    where = str(folder / CONFIG_FILE)
    raw = read_json(folder / CONFIG_FILE)
    if fmt == "speculators":
        return _verifier_aux_ids(read_speculators_config(raw, where), folder)
    return read_vllm_config(raw, where)


@dataclasses.dataclass(frozen=True)
class TargetSource:
    """Where a head's missing target-shared tensors come from (callables, None: not given)."""

    embeddings: object = None  # () -> [V, H] input embedding as the target's first layer sees it
    weights: object = None  # () -> (stored embedding [V, H], lm_head [V, H])

    def stored(self):
        return None if self.weights is None else self.weights()


def _verifier_aux_ids(config: DrafterConfig, folder: Path) -> DrafterConfig:
    """A speculators head without aux ids gets its verifier's defaults, as speculators and vLLM
    give it, when the verifier is on this machine."""
    found = None if config.aux_layer_ids is not None else resolve_verifier(config.verifier, folder)
    try:
        depth = None if found is None else target_facts(found)["num_layers"]
    except ConfigError:  # an unusable verifier config: no default, as when it is absent
        depth = None
    return config if depth is None else dataclasses.replace(config, aux_layer_ids=default_aux_layer_ids(depth))


@dataclasses.dataclass
class TensorCheck:
    """A checkpoint against the tensor table of a config, from the safetensors headers (d2t and
    t2d are read). Messages name the file and the tensor."""

    layer0: str  # how the checkpoint names layer 0: "midlayer." or "layers.0."
    rows: list  # (checkpoint key, our path, transform, checkpoint shape) per key_map row
    missing: dict  # table key -> expected shape, for tensors the checkpoint lacks (a full-vocab d2t is optional)
    errors: list  # wrong dtype, shape, id map or layer-0 naming
    reshaped: list  # mask_hidden holding the right values in another shape (the importer reshapes it)
    extra: list  # checkpoint keys outside the table


def check_tensors(ckpt, config: DrafterConfig) -> TensorCheck:
    """Checks `ckpt` (a `peagle_jax.sources.weights.Checkpoint`) against `config`'s tensor table; the one
    check behind both the importer (which raises on the first error) and the lint."""
    keys = set(ckpt.keys())
    layer0 = MIDLAYER if any(k.startswith(MIDLAYER) for k in keys) else LAYER0
    flat = flat_state(abstract_drafter(config)[1])
    rows = [
        (checkpoint_key(k, layer0), ours, t, checkpoint_shape(tuple(flat[ours].shape), t))
        for k, ours, t in key_map(config)
    ]
    assert {r[1] for r in rows} == set(flat), "drafter key table out of sync with DrafterModel"
    chk = TensorCheck(layer0, rows, {}, [], [], sorted(keys - {r[0] for r in rows} - {"t2d"}))
    if layer0 == MIDLAYER and any(k.startswith(LAYER0) for k in keys):
        bad = next(k for k in sorted(keys) if k.startswith(LAYER0))
        chk.errors.append(
            f"{ckpt.where[bad]}: both 'midlayer.*' and 'layers.0.*' tensors (e.g. {bad!r}): layer 0 "
            "must be one or the other"
        )
    for name, _, transform, want in rows:
        if name not in keys:
            if _needs_tensor(config, name):
                chk.missing[name] = want
        elif transform == "d2t":
            try:
                read_id_map(ckpt, config)
            except DrafterIOError as err:
                chk.errors.append(str(err))
        else:
            _check_float(ckpt, name, want, transform, chk)
    if "t2d" in keys and "d2t" not in keys:  # checked with d2t otherwise
        try:
            _check_t2d(ckpt, np.zeros(config.draft_vocab_size, np.int64), config.vocab_size)
        except DrafterIOError as err:
            chk.errors.append(str(err))
    return chk


def _check_float(ckpt, name: str, want: tuple, transform: str, chk: TensorCheck) -> None:
    got, dtype, src = ckpt.shape(name), ckpt.dtype(name), ckpt.where[name]
    if dtype not in FLOAT_DTYPES:
        chk.errors.append(f"{src}: tensor {name!r} has dtype {dtype}, expected a float type")
    if got == want:
        return
    if transform == "mask" and math.prod(got) == math.prod(want) and len(got) <= 3:
        chk.reshaped.append(name)
    else:
        hint = " (3 * target_hidden_size values, before fc)" if transform == "mask" else ""
        chk.errors.append(f"{src}: tensor {name!r} has shape {list(got)}, expected {list(want)}{hint}")


def _read_tensors(folder: Path, config: DrafterConfig, source: TargetSource) -> dict[tuple, np.ndarray]:
    ckpt = _checkpoint(folder)
    chk = check_tensors(ckpt, config)
    if chk.errors:
        raise DrafterIOError(chk.errors[0])
    if chk.extra:
        more = f" (and {len(chk.extra) - 1} more)" if len(chk.extra) > 1 else ""
        raise DrafterIOError(
            f"{ckpt.where[chk.extra[0]]}: unexpected tensor {chk.extra[0]!r}{more} for this config "
            f"(mode {config.mode}, {config.num_layers} layers)"
        )
    out: dict[tuple, np.ndarray] = {}
    absent = []
    for name, ours, transform, want in chk.rows:
        if name not in ckpt.where:
            absent.append((name, ours, want))
        elif transform == "d2t":
            out[ours] = read_id_map(ckpt, config)
        else:  # checked: a float tensor of the right size
            arr = _read(ckpt, name)
            arr = arr.reshape(want) if transform == "mask" else arr
            out[ours] = np.ascontiguousarray(arr.T) if transform == "linear" else arr
    for name, ours, want in sorted(absent, key=lambda row: row[0] != "d2t"):  # d2t first: lm_head rows use it
        out[ours] = _missing(folder, config, name, want, source, out)
    return out


def read_id_map(ckpt, config: DrafterConfig) -> np.ndarray:
    """A checkpoint's d2t [Vd] as int32, checked (an integer type, its shape, one-to-one into
    [0, V)) together with its t2d when it has one. DrafterIOError naming the file and tensor.
    `ckpt`: a `peagle_jax.sources.weights.Checkpoint`."""
    src = ckpt.where["d2t"]
    arr = _read(ckpt, "d2t")
    if arr.dtype.kind not in "iu":
        raise DrafterIOError(f"{src}: tensor 'd2t' has dtype {arr.dtype}, expected an integer type (int64)")
    if tuple(arr.shape) != (config.draft_vocab_size,):
        raise DrafterIOError(f"{src}: tensor 'd2t' has shape {list(arr.shape)}, expected [{config.draft_vocab_size}]")
    try:
        check_d2t(arr, config.vocab_size, f"{src}: tensor 'd2t'")
    except ValueError as err:
        raise DrafterIOError(str(err)) from None
    if "t2d" in ckpt.where:
        _check_t2d(ckpt, arr, config.vocab_size)
    return arr.astype(np.int32)


def _check_t2d(ckpt, d2t: np.ndarray, vocab_size: int) -> None:
    t2d = _read(ckpt, "t2d")
    if tuple(t2d.shape) != (vocab_size,):
        raise DrafterIOError(f"{ckpt.where['t2d']}: tensor 't2d' has shape {list(t2d.shape)}, expected [{vocab_size}]")
    if not np.array_equal(t2d.astype(bool), t2d_from_d2t(d2t.astype(np.int64), vocab_size)):
        raise DrafterIOError(f"{ckpt.where['t2d']}: tensor 't2d' does not match 'd2t'")


def _missing(folder: Path, config: DrafterConfig, key: str, want: tuple, source: TargetSource, got: dict):
    f = folder / SINGLE_FILE if (folder / SINGLE_FILE).exists() else folder
    if key == "d2t" and not _needs_tensor(config, key):
        return np.zeros(want, np.int32)  # full vocabulary: identity map
    if config.mode == "dflash" and key in TARGET_SHARED:
        return _from_target(f, config, key, want, source, got[("d2t",)])
    if key == "embed_tokens.weight":
        if source.embeddings is not None and config.mode == "chain":
            return _target_shaped(f, "embedding", source.embeddings(), want)
        raise DrafterIOError(
            f"{f}: missing tensor 'embed_tokens.weight'. A P-EAGLE head must ship its trained embeddings "
            "(vLLM would otherwise share the target's, whose mask-token row is untrained). For an "
            "EAGLE-3 chain head that shares the target's embeddings, pass target=load_target(...)."
        )
    if key == "mask_hidden":
        raise DrafterIOError(
            f"{f}: missing tensor 'mask_hidden' [1, 1, {config.fc_in}] required by a parallel (P-EAGLE) head "
            "(vLLM raises without it when parallel_drafting is on)"
        )
    raise DrafterIOError(f"{f}: missing tensor {key!r} (shape {list(want)})")


def _target_shaped(f: Path, what: str, arr, want: tuple) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.shape != tuple(want):
        raise DrafterIOError(f"{f}: target {what} shape {list(arr.shape)} != {list(want)}")
    return arr


def _from_target(f: Path, config: DrafterConfig, key: str, want: tuple, source: TargetSource, d2t) -> np.ndarray:
    """A DFlash head's embed_tokens / lm_head taken from the target (speculators saves neither
    for a full vocabulary, z-lab heads often ship none): the stored embedding rows, the lm_head
    rows of the draft vocabulary (draft id i -> target id i + d2t[i]) as our [H, Vd] kernel."""
    stored = source.stored()
    if stored is None and key == "embed_tokens.weight" and source.embeddings is not None:
        return _target_shaped(f, "embedding", source.embeddings(), want)
    if stored is None:
        raise DrafterIOError(
            f"{f}: missing tensor {key!r}: this DFlash head takes the target's (speculators does not save it); "
            "pass target=load_target(...) (peagle-convert import/export --target DIR)"
        )
    if key == "embed_tokens.weight":
        return _target_shaped(f, "embedding", stored[0], want)
    head = _target_shaped(f, "lm_head", stored[1], (config.vocab_size, config.hidden_size))
    ids = np.arange(config.draft_vocab_size) + np.asarray(d2t, np.int64)
    return np.ascontiguousarray(head[ids].T)


# ---------------------------------------------------------------------------------------
# export
def checkpoint_tensors(
    config: DrafterConfig, arrays: dict, dtype="bfloat16", layer0: str = LAYER0
) -> dict[str, np.ndarray]:
    """{checkpoint key: numpy array} of a drafter's arrays: floats in `dtype` (no copy when they
    already are), d2t int64 and t2d bool only for a reduced draft vocabulary (Vd < V)."""
    dt = numpy_dtype(dtype, EXPORT)
    out = {}
    for key, ours, transform in key_map(config):
        arr = np.asarray(arrays[ours])
        if transform == "d2t":
            if _needs_tensor(config, key):
                out[key] = np.ascontiguousarray(arr.astype(np.int64))
                out["t2d"] = t2d_from_d2t(out[key], config.vocab_size)
            elif np.any(arr):
                raise DrafterIOError(
                    "a full-vocabulary head (draft_vocab_size == vocab_size) with a non-zero d2t: "
                    "vLLM holds no id map for it"
                )
            continue
        arr = arr.astype(dt, copy=False)
        out[checkpoint_key(key, layer0)] = np.ascontiguousarray(arr.T if transform == "linear" else arr)
    return out


def vllm_tensors(config: DrafterConfig, arrays: dict, dtype="bfloat16") -> dict[str, np.ndarray]:
    """`checkpoint_tensors` in vLLM's native layout: layer 0 as `midlayer.*` (DFlash: `layers.0.*`,
    every tensor, embed_tokens and lm_head too, which vLLM's DFlash loader takes when present)."""
    return checkpoint_tensors(config, arrays, dtype, LAYER0 if config.mode == "dflash" else MIDLAYER)


def speculators_tensors(config: DrafterConfig, arrays: dict, dtype="bfloat16") -> dict[str, np.ndarray]:
    """`checkpoint_tensors` in the speculators layout: layer 0 as `layers.0.*`. DFlash heads as
    speculators' `DFlashDraftModel.save_pretrained` writes them: no embed_tokens, and an lm_head
    only with a draft vocabulary (both are the target's otherwise)."""
    out = checkpoint_tensors(config, arrays, dtype, LAYER0)
    if config.mode == "dflash":
        for key in TARGET_SHARED:
            if not _needs_tensor(config, key):
                out.pop(key)
    return out


def export_vllm(head, out: str | os.PathLike, dtype="bfloat16", *, overwrite: bool = False) -> Path:
    """vLLM-native folder of `head` (anything with `.config` and `.arrays()`, e.g. a Drafter):
    `midlayer.*`, mask id under all three keys. Serve it with the command
    `peagle_jax.formats.inspect.serve_command` prints."""
    c = head.config
    return write_hf_folder(out, vllm_config(c, dtype), vllm_tensors(c, head.arrays(), dtype), overwrite=overwrite)


def export_speculators(
    head, out: str | os.PathLike, dtype="bfloat16", *, overwrite: bool = False, verifier: str | None = None
) -> Path:
    """speculators folder of `head` (`layers.0.*`, speculators_model_type peagle / eagle3).
    `verifier` overrides the recorded target name_or_path (vLLM wants a hub id there)."""
    c = head.config
    return write_hf_folder(
        out, speculators_config(c, dtype, verifier), speculators_tensors(c, head.arrays(), dtype), overwrite=overwrite
    )
