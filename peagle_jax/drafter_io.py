"""Drafter folders of other tools <-> `Drafter` (reference/peagle.md section 6).

Two layouts, both `config.json` + `model.safetensors` (or a sharded index) with flat keys:

- vLLM native (`architectures: ["LlamaForCausalLMEagle3"]`, model_type llama): layer 0 as
  `midlayer.*` (or `layers.0.*`), later layers `layers.{i}.*`; the mask id under
  `mask_token_id` / `pard_token` / `ptd_token_id`; aux ids top level or in `eagle_config`.
- speculators (`speculators_model_type: "peagle"` or `"eagle3"`): the layer shape in
  `transformer_layer_config`, weights under `layers.{i}.*`.

Tensor names (PyTorch [out, in]): embed_tokens.weight [V, H], fc.weight [H, 3Ht],
input_norm.weight [3Ht] (norm_before_fc), fc_norm.{0,1,2}.weight [Ht] (fc_norm),
layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H],
layers.{i}.self_attn.{q,k,v}_proj.weight [heads*hd, 2H (layer 0) | H] (+ .bias with
attention_bias, o_proj too), layers.{i}.self_attn.{q,k}_norm.weight [hd] (qk_norm),
layers.{i}.mlp.{gate,up,down}_proj.weight, norm.weight [H], lm_head.weight [Vd, H],
d2t [Vd] int64, t2d [V] bool, mask_hidden [1, 1, 3Ht] (parallel heads).

Import validates every key and shape: errors (`DrafterIOError`, `ConfigError`) name the file
and the key. Export writes bf16 by default (d2t int64, t2d bool) into a temporary sibling
folder and renames it into place.

Semantics taken from vLLM (the serving contract) where the tools differ:
- `norm_before_residual` missing from a speculators config defaults to True for "eagle3" and
  False for "peagle" (vLLM's speculators config translation); missing from a vLLM-native
  config it is False.
- `norm_before_fc` is read from `eagle_config` first, then the top level (vLLM).
- o_proj carries a bias whenever `attention_bias` is set (Hugging Face and vLLM Llama).
- A full-vocabulary head may omit d2t/t2d (speculators does); a reduced one may not.
- `norm_output` (EAGLE 3.1): chain mode feeds the post-norm state back (`DrafterModel.feedback`).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from peagle_jax.config import ConfigError, RopeConfig, read_json
from peagle_jax.folders import CONFIG_FILE, SINGLE_FILE, write_hf_folder
from peagle_jax.drafter import (
    NUM_AUX,
    Drafter,
    DrafterConfig,
    _target_arrays,
    abstract_drafter,
    flat_state,
    state_from_arrays,
    t2d_from_d2t,
)

__all__ = [
    "DrafterIOError",
    "detect_format",
    "import_drafter",
    "read_vllm_config",
    "read_speculators_config",
    "key_table",
    "hf_tensors",
    "export_vllm",
    "export_speculators",
    "VLLM_ARCHITECTURES",
]

# vLLM registry names of EAGLE-3 style heads -> whether the layers are Qwen3 (q/k norms)
VLLM_ARCHITECTURES = {
    "LlamaForCausalLMEagle3": False,
    "Eagle3LlamaForCausalLM": False,
    "PeagleLlamaForCausalLM": False,
    "Eagle3Qwen3ForCausalLM": True,
    "PeagleQwen3ForCausalLM": True,
}
SPECULATORS_TYPES = {"peagle": "parallel", "eagle3": "chain"}
SPECULATORS_ARCH = {"peagle": "PEagleSpeculator", "eagle3": "Eagle3Speculator"}
SPECULATORS_VERSION = "0.9.0"
MASK_ID_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")
# verifier architectures <-> our target families
TARGET_ARCHS = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
ARCH_OF_FAMILY = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                  "gpt_oss": "GptOssForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
DEFAULT_K_TRAIN = 8  # COD depth of the reference recipe, recorded when a head names none
EXTRA_KEY = "peagle_jax"  # our own fields in a vLLM config.json (mode, k_train, ...)


class DrafterIOError(ValueError):
    """A drafter folder that cannot be used; the message names the file and key."""


# ---------------------------------------------------------------------------------------
# key table
def key_table(cfg: DrafterConfig) -> list[tuple[str, tuple, str]]:
    """(checkpoint key with layer 0 as `layers.0.`, our state path, transform) per tensor.

    transform: "linear" (transpose), "identity", "d2t" (int offsets), "mask" (mask_hidden).
    """
    rows: list[tuple[str, tuple, str]] = [
        ("embed_tokens.weight", ("embed_tokens", "embedding"), "identity"),
        ("fc.weight", ("fc", "kernel"), "linear"),
    ]
    if cfg.norm_before_fc:
        rows.append(("input_norm.weight", ("input_norm", "weight"), "identity"))
    if cfg.fc_norm:
        rows += [(f"fc_norm.{j}.weight", ("fc_norm", j, "weight"), "identity") for j in range(NUM_AUX)]
    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        norms = ["input_layernorm", "post_attention_layernorm"] + (["hidden_norm"] if i == 0 else [])
        rows += [(f"{pre}{n}.weight", ("layers", i, n, "weight"), "identity") for n in norms]
        for p in "qkvo":
            proj = ("layers", i, "self_attn", f"{p}_proj")
            rows.append((f"{pre}self_attn.{p}_proj.weight", proj + ("kernel",), "linear"))
            if cfg.attention_bias:
                rows.append((f"{pre}self_attn.{p}_proj.bias", proj + ("bias",), "identity"))
        if cfg.qk_norm:
            rows += [(f"{pre}self_attn.{n}.weight", ("layers", i, "self_attn", n, "weight"), "identity")
                     for n in ("q_norm", "k_norm")]
        rows += [(f"{pre}mlp.{p}_proj.weight", ("layers", i, "mlp", f"{p}_proj", "kernel"), "linear")
                 for p in ("gate", "up", "down")]
    rows += [
        ("norm.weight", ("norm", "weight"), "identity"),
        ("lm_head.weight", ("lm_head", "kernel"), "linear"),
        ("d2t", ("d2t",), "d2t"),
    ]
    if cfg.mode == "parallel":
        rows.append(("mask_hidden", ("mask_hidden",), "mask"))
    return rows


def _hf_shape(shape: tuple, transform: str) -> tuple:
    return tuple(reversed(shape)) if transform == "linear" else tuple(shape)


# ---------------------------------------------------------------------------------------
# config.json parsing
def _req(cfg: dict, key: str, where: str, kind=int):
    if cfg.get(key) is None:
        raise ConfigError(f"{where}: missing key {key!r}")
    try:
        value = kind(cfg[key])
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: key {key!r} has invalid value {cfg[key]!r}") from None
    return value


def _bool(cfg: dict, key: str, where: str, default: bool = False) -> bool:
    value = cfg.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: key {key!r} must be true or false, got {value!r}")
    return value


def _rope(cfg: dict, where: str) -> RopeConfig:
    params = cfg.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or "full_attention" in params:
            raise ConfigError(f"{where}: key 'rope_parameters' must be one flat rope dict")
        return RopeConfig.from_dict(params, float(cfg.get("rope_theta", 10000.0)), f"{where} key 'rope_parameters'")
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ConfigError(f"{where}: key 'rope_scaling' must be a dict or null")
    return RopeConfig.from_dict({**scaling, "rope_theta": cfg.get("rope_theta", 10000.0)}, 10000.0,
                                f"{where} key 'rope_scaling'")


def _layer_shape(tl: dict, where: str) -> dict:
    """The Llama-layer fields shared by both layouts."""
    hidden = _req(tl, "hidden_size", where)
    heads = _req(tl, "num_attention_heads", where)
    if tl.get("mlp_bias"):
        raise ConfigError(f"{where}: key 'mlp_bias' is true; drafter MLPs have no bias (vLLM Llama heads)")
    if tl.get("use_sliding_window") or "sliding_attention" in (tl.get("layer_types") or []):
        raise ConfigError(f"{where}: sliding-window drafter layers are unsupported (all drafter layers are full "
                          "attention, as vLLM serves them)")
    act = tl.get("hidden_act", "silu")
    return dict(
        hidden_size=hidden,
        num_layers=_req(tl, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=int(tl.get("num_key_value_heads") or heads),
        head_dim=int(tl.get("head_dim") or hidden // heads),
        intermediate_size=_req(tl, "intermediate_size", where),
        vocab_size=_req(tl, "vocab_size", where),
        rms_norm_eps=float(tl.get("rms_norm_eps", 1e-6)),
        rope=_rope(tl, where),
        max_position_embeddings=int(tl.get("max_position_embeddings", 2048)),
        attention_bias=_bool(tl, "attention_bias", where),
        hidden_act=act,
    )


def _aux_ids(value, where: str, key: str):
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != NUM_AUX or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    ):
        raise ConfigError(f"{where}: key {key!r} must list {NUM_AUX} layer ids, got {value!r}")
    return tuple(value)


def _make_config(where: str, **kw) -> DrafterConfig:
    try:
        return DrafterConfig(**kw)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None


def read_vllm_config(cfg: dict, where: str) -> DrafterConfig:
    arch = cfg.get("architectures") or []
    known = [a for a in arch if a in VLLM_ARCHITECTURES]
    if not known:
        raise ConfigError(
            f"{where}: key 'architectures' is {arch!r}, not a drafter head "
            f"(known: {', '.join(VLLM_ARCHITECTURES)} or a speculators config)"
        )
    shape = _layer_shape(cfg, where)
    eagle = cfg.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise ConfigError(f"{where}: key 'eagle_config' must be a dict")
    if eagle.get("use_aux_hidden_state") is False:
        raise ConfigError(f"{where}: key 'eagle_config.use_aux_hidden_state' is false (EAGLE-1 heads are unsupported)")
    aux = _aux_ids(cfg.get("eagle_aux_hidden_state_layer_ids"), where, "eagle_aux_hidden_state_layer_ids")
    inner = _aux_ids(eagle.get("eagle_aux_hidden_state_layer_ids"), where,
                     "eagle_config.eagle_aux_hidden_state_layer_ids")
    if aux is not None and inner is not None and aux != inner:
        raise ConfigError(f"{where}: 'eagle_aux_hidden_state_layer_ids' {list(aux)} differs from "
                          f"'eagle_config.eagle_aux_hidden_state_layer_ids' {list(inner)}")
    aux = aux if aux is not None else inner
    ids = {k: cfg[k] for k in MASK_ID_KEYS if cfg.get(k) is not None}
    if len(set(map(str, ids.values()))) > 1:
        raise ConfigError(f"{where}: the mask token keys disagree: {ids}")
    mask_id = None
    if ids:
        key, value = next(iter(ids.items()))
        try:
            mask_id = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: key {key!r} has invalid value {value!r}") from None
    extra = cfg.get(EXTRA_KEY) or {}
    mode = extra.get("mode") or ("parallel" if mask_id is not None else "chain")
    nbfc = eagle.get("norm_before_fc", cfg.get("norm_before_fc", False))
    hidden = shape["hidden_size"]
    return _make_config(
        where,
        **shape,
        target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
        draft_vocab_size=int(cfg.get("draft_vocab_size") or shape["vocab_size"]),
        mode=mode,
        mask_token_id=mask_id,
        aux_layer_ids=aux,
        k_train=extra.get("k_train"),
        norm_before_residual=_bool(cfg, "norm_before_residual", where),
        norm_before_fc=_bool({"norm_before_fc": nbfc}, "norm_before_fc", where),
        fc_norm=_bool(cfg, "fc_norm", where),
        norm_output=_bool(cfg, "norm_output", where),
        qk_norm=VLLM_ARCHITECTURES[known[0]],
        target_model_type=extra.get("target_model_type"),
        verifier=extra.get("verifier"),
    )


def read_speculators_config(cfg: dict, where: str, folder: Path | None = None) -> DrafterConfig:
    kind = cfg.get("speculators_model_type")
    if kind not in SPECULATORS_TYPES:
        raise ConfigError(f"{where}: key 'speculators_model_type' is {kind!r} "
                          f"(supported: {', '.join(SPECULATORS_TYPES)})")
    tl = cfg.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise ConfigError(f"{where}: missing key 'transformer_layer_config'")
    tl_where = f"{where} key 'transformer_layer_config'"
    tl_type = tl.get("model_type", "llama")
    if tl_type not in ("llama", "qwen3"):
        raise ConfigError(f"{tl_where}: model_type {tl_type!r} unsupported (llama, qwen3)")
    shape = _layer_shape(tl, tl_where)
    mode = SPECULATORS_TYPES[kind]
    mask_id = cfg.get("mask_token_id")
    if mode == "parallel" and mask_id is None:
        raise ConfigError(f"{where}: missing key 'mask_token_id' (required for a peagle head)")
    spec = cfg.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    k_train = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    verifier = spec.get("verifier") or {}
    archs = verifier.get("architectures") or []
    family = next((TARGET_ARCHS[a] for a in archs if a in TARGET_ARCHS), None)
    aux = _aux_ids(cfg.get("eagle_aux_hidden_state_layer_ids"), where, "eagle_aux_hidden_state_layer_ids")
    name = verifier.get("name_or_path")
    if aux is None and name and folder is not None:  # speculators/vLLM default from the verifier's depth
        vcfg = (folder / name / CONFIG_FILE) if not Path(name).is_absolute() else Path(name) / CONFIG_FILE
        if vcfg.exists():
            n = int(read_json(vcfg).get("num_hidden_layers") or 0)
            if n:
                aux = (2, n // 2, n - 3)
    hidden = shape["hidden_size"]
    return _make_config(
        where,
        **shape,
        target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
        draft_vocab_size=int(cfg.get("draft_vocab_size") or shape["vocab_size"]),
        mode=mode,
        mask_token_id=None if mask_id is None else int(mask_id),
        aux_layer_ids=aux,
        k_train=k_train,
        norm_before_residual=_bool(cfg, "norm_before_residual", where, default=kind == "eagle3"),
        norm_before_fc=_bool(cfg, "norm_before_fc", where),
        fc_norm=_bool(cfg, "fc_norm", where),
        norm_output=_bool(cfg, "norm_output", where),
        qk_norm=tl_type == "qwen3",
        target_model_type=family,
        verifier=name,
    )


def detect_format(path: str | os.PathLike) -> str:
    """"own" (drafter.json), "speculators" or "vllm" (config.json)."""
    p = Path(path)
    if (p / "drafter.json").exists():
        return "own"
    if not p.is_dir():
        raise FileNotFoundError(f"{p}: no such folder")
    cfg = read_json(p / CONFIG_FILE)
    if "speculators_model_type" in cfg:
        return "speculators"
    read_vllm_config(cfg, str(p / CONFIG_FILE))  # raises on an unknown architecture
    return "vllm"


# ---------------------------------------------------------------------------------------
# import
def _checkpoint(folder: Path):
    from peagle_jax.weights import Checkpoint, WeightsError

    try:
        return Checkpoint(folder)
    except WeightsError as err:
        raise DrafterIOError(str(err)) from None


def _read(ckpt, key: str) -> np.ndarray:
    try:
        return np.asarray(ckpt.read(key))
    except Exception as err:
        raise DrafterIOError(str(err)) from None


def import_drafter(path: str | os.PathLike, *, target=None, dtype="float32") -> Drafter:
    """A vLLM-native or speculators folder -> Drafter (float32 unless `dtype` says otherwise)."""
    folder = Path(path)
    fmt = detect_format(folder)
    if fmt == "own":
        from peagle_jax.drafter import load_drafter

        return load_drafter(folder, dtype=dtype)
    where = str(folder / CONFIG_FILE)
    raw = read_json(folder / CONFIG_FILE)
    if fmt == "speculators":
        config = read_speculators_config(raw, where, folder)
    else:
        config = read_vllm_config(raw, where)
    arrays = _read_tensors(folder, config, target)
    graphdef, state = state_from_arrays(config, arrays, dtype, where=f"{folder}: ")
    return Drafter(config, graphdef, state, path=folder)


def _read_tensors(folder: Path, config: DrafterConfig, target) -> dict[tuple, np.ndarray]:
    ckpt = _checkpoint(folder)
    keys = set(ckpt.keys())
    mid = any(k.startswith("midlayer.") for k in keys)
    if mid and any(k.startswith("layers.0.") for k in keys):
        bad = next(k for k in sorted(keys) if k.startswith("layers.0."))
        raise DrafterIOError(f"{ckpt.where[bad]}: both 'midlayer.*' and 'layers.0.*' tensors (e.g. {bad!r})")
    _, abstract = abstract_drafter(config)
    flat = flat_state(abstract)
    rows = key_table(config)
    assert {r[1] for r in rows} == set(flat), "drafter key table out of sync with DrafterModel"

    def name(key: str) -> str:
        return "midlayer." + key[len("layers.0."):] if mid and key.startswith("layers.0.") else key

    out: dict[tuple, np.ndarray] = {}
    consumed = set()
    for key, ours, transform in rows:
        k = name(key)
        want = _hf_shape(tuple(flat[ours].shape), transform)
        if k not in keys:
            out[ours] = _missing(folder, ckpt, config, k, want, target)
            continue
        consumed.add(k)
        src = ckpt.where[k]
        arr = _read(ckpt, k)
        if transform == "d2t":
            if arr.dtype.kind not in "iu":
                raise DrafterIOError(f"{src}: tensor {k!r} has dtype {arr.dtype}, expected an integer type")
            if tuple(arr.shape) != want:
                raise DrafterIOError(f"{src}: tensor {k!r} has shape {list(arr.shape)}, expected {list(want)}")
            targets = np.arange(want[0], dtype=np.int64) + arr.astype(np.int64)
            if targets.min() < 0 or targets.max() >= config.vocab_size or np.unique(targets).size != want[0]:
                raise DrafterIOError(f"{src}: tensor {k!r} maps draft ids outside [0, {config.vocab_size}) "
                                     "or onto the same target id twice")
            out[ours] = arr.astype(np.int32)
            continue
        if arr.dtype.kind != "f" and arr.dtype != np.dtype(ml_dtypes.bfloat16):
            raise DrafterIOError(f"{src}: tensor {k!r} has dtype {arr.dtype}, expected a float type")
        if transform == "mask":
            if arr.size != want[-1] or arr.ndim > 3:
                raise DrafterIOError(f"{src}: tensor {k!r} has shape {list(arr.shape)}, expected {list(want)}")
            arr = arr.reshape(want)
        elif tuple(arr.shape) != want:
            raise DrafterIOError(f"{src}: tensor {k!r} has shape {list(arr.shape)}, expected {list(want)}")
        out[ours] = np.ascontiguousarray(arr.T if transform == "linear" else arr).astype(np.float32)
    if "t2d" in keys:
        consumed.add("t2d")
        t2d = _read(ckpt, "t2d")
        if tuple(t2d.shape) != (config.vocab_size,):
            raise DrafterIOError(f"{ckpt.where['t2d']}: tensor 't2d' has shape {list(t2d.shape)}, "
                                 f"expected [{config.vocab_size}]")
        if not np.array_equal(t2d.astype(bool), t2d_from_d2t(out[("d2t",)].astype(np.int64), config.vocab_size)):
            raise DrafterIOError(f"{ckpt.where['t2d']}: tensor 't2d' does not match 'd2t'")
    extra = sorted(keys - consumed)
    if extra:
        raise DrafterIOError(f"{ckpt.where[extra[0]]}: unexpected tensor {extra[0]!r}"
                             + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                             + f" for this config (mode {config.mode}, {config.num_layers} layers)")
    return out


def _missing(folder: Path, ckpt, config: DrafterConfig, key: str, want: tuple, target) -> np.ndarray:
    f = folder / SINGLE_FILE if (folder / SINGLE_FILE).exists() else folder
    if key == "d2t" and config.draft_vocab_size == config.vocab_size:
        return np.zeros(want, np.int32)  # full vocabulary: identity map
    if key == "embed_tokens.weight":
        if target is not None and config.mode == "chain":
            emb, _ = _target_arrays(target)
            if emb.shape != want:
                raise DrafterIOError(f"{f}: target embedding shape {list(emb.shape)} != {list(want)}")
            return emb
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


# ---------------------------------------------------------------------------------------
# export
def _np_dtype(dtype):
    names = {"bfloat16": ml_dtypes.bfloat16, "bf16": ml_dtypes.bfloat16, "float32": np.float32, "f32": np.float32,
             "float16": np.float16, "f16": np.float16}
    if isinstance(dtype, str):
        if dtype not in names:
            raise ValueError(f"unsupported export dtype {dtype!r} (bfloat16, float32, float16)")
        return np.dtype(names[dtype])
    return np.dtype(dtype)


def hf_tensors(drafter: Drafter, dtype="bfloat16", layer0: str = "layers.0.") -> dict[str, np.ndarray]:
    """{checkpoint key: numpy array} of the drafter (floats in `dtype`, d2t int64, t2d bool)."""
    dt = _np_dtype(dtype)
    flat = flat_state(drafter.state)
    out = {}
    for key, ours, transform in key_table(drafter.config):
        arr = np.asarray(jax.device_get(flat[ours][...]))
        if key.startswith("layers.0."):
            key = layer0 + key[len("layers.0."):]
        if transform == "d2t":
            out[key] = np.ascontiguousarray(arr.astype(np.int64))
            continue
        if transform == "linear":
            arr = arr.T
        out[key] = np.ascontiguousarray(np.asarray(jax.numpy.asarray(arr).astype(dt)))
    out["t2d"] = t2d_from_d2t(out["d2t"], drafter.config.vocab_size)
    return out


def _rope_fields(rope: RopeConfig) -> dict:
    hf = rope.to_hf()
    scaling = None if rope.type == "default" else {k: v for k, v in hf.items() if k != "rope_theta"}
    return {"rope_theta": rope.theta, "rope_scaling": scaling, "rope_parameters": hf}


def _llama_fields(c: DrafterConfig) -> dict:
    return {
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        **_rope_fields(c.rope),
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "hidden_act": c.hidden_act,
        "attention_bias": c.attention_bias,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def _dtype_name(dtype) -> str:
    return {np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.float32): "float32",
            np.dtype(np.float16): "float16"}[_np_dtype(dtype)]


def vllm_config(drafter: Drafter, dtype="bfloat16") -> dict:
    c = drafter.config
    if c.qk_norm:
        raise DrafterIOError("export_vllm: this head has q/k norms (a Qwen3 layer config), which vLLM's "
                             "Llama EAGLE-3 layout cannot hold; export the speculators layout instead")
    aux = None if c.aux_layer_ids is None else list(c.aux_layer_ids)
    out = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **_llama_fields(c),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        "eagle_config": {"use_aux_hidden_state": True, "norm_before_fc": c.norm_before_fc},
        "torch_dtype": _dtype_name(dtype),
        EXTRA_KEY: {"mode": c.mode, "k_train": c.k_train, "target_model_type": c.target_model_type,
                    "verifier": c.verifier},
    }
    if aux is not None:
        out["eagle_aux_hidden_state_layer_ids"] = aux
        out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = aux
    if c.mask_token_id is not None:
        out.update({k: c.mask_token_id for k in MASK_ID_KEYS})
    return out


def speculators_config(drafter: Drafter, dtype="bfloat16", verifier: str | None = None) -> dict:
    c = drafter.config
    kind = "peagle" if c.mode == "parallel" else "eagle3"
    tl = {"model_type": "qwen3" if c.qk_norm else "llama", **_llama_fields(c)}
    tl.pop("rope_scaling")
    tl.pop("rope_theta")
    name = verifier if verifier is not None else c.verifier
    arch = ARCH_OF_FAMILY.get(c.target_model_type or "")
    out = {
        "architectures": [SPECULATORS_ARCH[kind]],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": tl,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "fc_norm": c.fc_norm,
        "norm_output": c.norm_output,
        "embed_requires_grad": True,
        "tie_word_embeddings": False,
        "eagle_aux_hidden_state_layer_ids": None if c.aux_layer_ids is None else list(c.aux_layer_ids),
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.k_train or DEFAULT_K_TRAIN,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": name, "architectures": [arch] if arch else []},
        },
        "dtype": _dtype_name(dtype),
    }
    if c.mask_token_id is not None:
        out["mask_token_id"] = c.mask_token_id
    return out


def _write(out: str | os.PathLike, config: dict, tensors: dict, overwrite: bool) -> Path:
    return write_hf_folder(out, config, tensors, overwrite=overwrite)


def export_vllm(drafter: Drafter, out: str | os.PathLike, dtype="bfloat16", *, overwrite: bool = False) -> Path:
    """vLLM-native folder (`midlayer.*`, mask id under all three keys). Serve with
    --speculative-config '{"method": "eagle3", "model": OUT, "num_speculative_tokens": K,
    "parallel_drafting": true}'."""
    return _write(out, vllm_config(drafter, dtype), hf_tensors(drafter, dtype, "midlayer."), overwrite)


def speculators_tensors(drafter: Drafter, dtype="bfloat16") -> dict[str, np.ndarray]:
    """`hf_tensors` in the speculators layout: `layers.0.*`, and no d2t/t2d for a full
    draft vocabulary (speculators registers those buffers only when Vd < V)."""
    tensors = hf_tensors(drafter, dtype, "layers.0.")
    if drafter.config.draft_vocab_size == drafter.config.vocab_size:
        tensors.pop("d2t", None)
        tensors.pop("t2d", None)
    return tensors


def export_speculators(drafter: Drafter, out: str | os.PathLike, dtype="bfloat16", *, overwrite: bool = False,
                       verifier: str | None = None) -> Path:
    """speculators folder (`layers.0.*`, speculators_model_type peagle / eagle3). `verifier`
    overrides the recorded target name_or_path."""
    return _write(out, speculators_config(drafter, dtype, verifier), speculators_tensors(drafter, dtype), overwrite)
