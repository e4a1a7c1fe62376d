"""Hugging Face safetensors <-> Flax NNX parameters for the target families.

One key-map table per family (`KEY_MAPS`): each row is
``(hf_key, our_path, transform, condition)`` with ``{i}`` standing for the layer index.
`transform` is ``"linear"`` (PyTorch ``[out, in]`` weight <-> NNX kernel ``[in, out]``: a
transpose) or ``"identity"`` (embeddings, norms, biases). `condition` names the config
flag a row depends on (``None`` = always present).

Loading reads `model.safetensors` or a sharded `model.safetensors.index.json`, checks
that every tensor the model needs is there with the right shape, that every tensor in the
checkpoint is consumed (Hugging Face's non-parameter buffers such as ``rotary_emb.inv_freq``
are skipped; a tied model's duplicated ``lm_head.weight`` is accepted when it equals the
embedding) and fills an abstract model built with `nnx.eval_shape`, so the full model is
never randomly initialised. Errors are `WeightsError` and name the file and key.

Export writes ``config.json`` (`TargetConfig.to_hf`) and ``model.safetensors`` into a
temporary folder beside the destination, then renames it into place.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from peagle_jax.config import TargetConfig
from peagle_jax.folders import INDEX_FILE, SINGLE_FILE, write_hf_folder

# Hugging Face buffers that may appear in old checkpoints and are not parameters.
IGNORED_KEYS = (re.compile(r"(^|\.)rotary_emb\.(inv_freq|original_inv_freq)$"), re.compile(r"\.embed_scale$"))
DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "f32": jnp.float32,
    "bf16": jnp.bfloat16,
}
_FLOAT_SAFETENSORS = {"F64", "F32", "F16", "BF16"}


class WeightsError(ValueError):
    """A checkpoint that cannot be used; the message names the file and key."""


# ---------------------------------------------------------------------------------------
# key maps: (hf_key, our_path, transform, condition)
_ATTN = [
    (f"model.layers.{{i}}.self_attn.{p}_proj.weight", f"layers.{{i}}.self_attn.{p}_proj.kernel", "linear", None)
    for p in "qkvo"
] + [
    (f"model.layers.{{i}}.self_attn.{p}_proj.bias", f"layers.{{i}}.self_attn.{p}_proj.bias", "identity",
     "attention_bias")
    for p in "qkvo"
]
_MLP = [
    (f"model.layers.{{i}}.mlp.{p}_proj.weight", f"layers.{{i}}.mlp.{p}_proj.kernel", "linear", None)
    for p in ("gate", "up", "down")
] + [
    (f"model.layers.{{i}}.mlp.{p}_proj.bias", f"layers.{{i}}.mlp.{p}_proj.bias", "identity", "mlp_bias")
    for p in ("gate", "up", "down")
]
_NORMS = [
    (f"model.layers.{{i}}.{n}.weight", f"layers.{{i}}.{n}.weight", "identity", None)
    for n in ("input_layernorm", "post_attention_layernorm")
]
_QK_NORM = [
    (f"model.layers.{{i}}.self_attn.{n}.weight", f"layers.{{i}}.self_attn.{n}.weight", "identity", None)
    for n in ("q_norm", "k_norm")
]
_SANDWICH = [
    (f"model.layers.{{i}}.{n}.weight", f"layers.{{i}}.{n}.weight", "identity", None)
    for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")
]
_TOP = [
    ("model.embed_tokens.weight", "embed_tokens.embedding", "identity", None),
    ("model.norm.weight", "norm.weight", "identity", None),
    ("lm_head.weight", "lm_head.kernel", "linear", "untied"),
]
KEY_MAPS: dict[str, list[tuple[str, str, str, str | None]]] = {
    "llama": _TOP + _NORMS + _ATTN + _MLP,
    "qwen3": _TOP + _NORMS + _ATTN + _QK_NORM + _MLP,
    "gemma3": _TOP + _NORMS + _SANDWICH + _ATTN + _QK_NORM + _MLP,
}
TIED_LM_HEAD = "lm_head.weight"


def _condition(cfg: TargetConfig, cond: str | None) -> bool:
    if cond is None:
        return True
    if cond == "untied":
        return not cfg.tie_word_embeddings
    return bool(getattr(cfg, cond))


def key_map(cfg: TargetConfig) -> list[tuple[str, tuple, str]]:
    """The expanded table for `cfg`: (hf_key, our path tuple, transform), one row per tensor."""
    if cfg.model_type not in KEY_MAPS:
        raise WeightsError(f"no weight key map for model_type {cfg.model_type!r}")
    rows = []
    for hf, ours, transform, cond in KEY_MAPS[cfg.model_type]:
        if not _condition(cfg, cond):
            continue
        layers = range(cfg.num_layers) if "{i}" in hf else [None]
        for i in layers:
            h = hf.format(i=i) if i is not None else hf
            o = ours.format(i=i) if i is not None else ours
            rows.append((h, tuple(int(p) if p.isdigit() else p for p in o.split(".")), transform))
    return rows


def _to_hf_shape(shape: tuple, transform: str) -> tuple:
    return tuple(reversed(shape)) if transform == "linear" else tuple(shape)


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r} (supported: float32, bfloat16)")
        return jnp.dtype(DTYPES[dtype])
    d = jnp.dtype(dtype)
    if d not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"unsupported dtype {d} (supported: float32, bfloat16)")
    return d


# ---------------------------------------------------------------------------------------
# reading
class Checkpoint:
    """The tensors of a Hugging Face folder: key -> file, read lazily (one open handle per file)."""

    def __init__(self, folder: str | os.PathLike):
        from safetensors import safe_open

        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise WeightsError(f"{self.folder}: no such folder")
        index = self.folder / INDEX_FILE
        single = self.folder / SINGLE_FILE
        self.where: dict[str, Path] = {}
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise WeightsError(f"{index}: unreadable index ({err!r})") from None
            files = sorted(set(weight_map.values()))
        elif single.exists():
            weight_map, files = None, [SINGLE_FILE]
        else:
            others = sorted(p.name for p in self.folder.iterdir() if p.suffix in (".bin", ".pt", ".gguf"))
            hint = f" (found {', '.join(others)}: only safetensors is supported)" if others else ""
            raise WeightsError(f"{self.folder}: neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
        self._handles = {}
        for name in files:
            path = self.folder / name
            if not path.exists():
                raise WeightsError(f"{index}: shard {name!r} listed in the index is missing ({path})")
            try:
                handle = safe_open(str(path), framework="np")
            except Exception as err:  # safetensors raises its own error types
                raise WeightsError(f"{path}: unreadable safetensors file ({err})") from None
            self._handles[path] = handle
            for key in handle.keys():
                if key in self.where:
                    raise WeightsError(f"{path}: tensor {key!r} also appears in {self.where[key]}")
                self.where[key] = path
        if weight_map is not None:
            for key, name in weight_map.items():
                got = self.where.get(key)
                if got is None:
                    raise WeightsError(f"{self.folder / name}: tensor {key!r} listed in {INDEX_FILE} is missing")
                if got.name != name:
                    raise WeightsError(f"{got}: tensor {key!r} is listed in {INDEX_FILE} under {name!r}")

    def keys(self) -> list[str]:
        return list(self.where)

    def shape(self, key: str) -> tuple:
        return tuple(self._handles[self.where[key]].get_slice(key).get_shape())

    def dtype(self, key: str) -> str:
        return self._handles[self.where[key]].get_slice(key).get_dtype()

    def read(self, key: str) -> np.ndarray:
        try:
            return self._handles[self.where[key]].get_tensor(key)
        except Exception as err:
            raise WeightsError(f"{self.where[key]}: cannot read tensor {key!r} ({err})") from None


def _set_path(tree: dict, path: tuple, value) -> None:
    for p in path[:-1]:
        tree = tree[p]
    tree[path[-1]] = value


def abstract_model(cfg: TargetConfig, dtype="float32"):
    """(graphdef, abstract state) of the target Decoder: shapes only, nothing allocated."""
    from peagle_jax.models.decoder import Decoder

    d = resolve_dtype(dtype)
    model = nnx.eval_shape(lambda: Decoder(cfg, dtype=d, param_dtype=d, rngs=nnx.Rngs(0)))
    return nnx.split(model)


def _flat_params(state) -> dict[tuple, object]:
    return {tuple(path): var for path, var in nnx.to_flat_state(state)}


def load_params(folder: str | os.PathLike, cfg: TargetConfig, dtype="float32"):
    """Reads the folder's safetensors into (graphdef, state) of the target Decoder.

    Every tensor of the key map must be present with its shape; every tensor of the
    checkpoint must be consumed. Values are cast to `dtype` (float32 or bfloat16).
    """
    d = resolve_dtype(dtype)
    np_dtype = np.float32 if d == jnp.float32 else ml_dtypes.bfloat16
    ckpt = Checkpoint(folder)
    graphdef, abstract = abstract_model(cfg, d)
    flat = _flat_params(abstract)
    rows = key_map(cfg)
    covered = {ours for _, ours, _ in rows}
    if covered != set(flat):  # the table and the module tree must agree (a bug, not bad input)
        raise AssertionError(f"key map / model mismatch: {sorted(set(flat) ^ covered)}")

    values: dict[tuple, jax.Array] = {}
    for hf_key, ours, transform in rows:
        if hf_key not in ckpt.where:
            raise WeightsError(f"{ckpt.folder}: missing tensor {hf_key!r} (model_type {cfg.model_type!r})")
        values[ours] = _read_checked(ckpt, hf_key, flat[ours].shape, transform, np_dtype)

    consumed = {hf for hf, _, _ in rows}
    for key in ckpt.keys():
        if key in consumed or any(p.search(key) for p in IGNORED_KEYS):
            continue
        if key == TIED_LM_HEAD and cfg.tie_word_embeddings:
            emb = ("embed_tokens", "embedding")
            head = _read_checked(ckpt, key, flat[emb].shape, "identity", np_dtype)  # both [V, H]
            if not np.array_equal(np.asarray(head), np.asarray(values[emb])):
                raise WeightsError(
                    f"{ckpt.where[key]}: tensor {key!r} differs from 'model.embed_tokens.weight' but the "
                    "config ties word embeddings (tie_word_embeddings: true)"
                )
            continue
        raise WeightsError(f"{ckpt.where[key]}: unexpected tensor {key!r} (model_type {cfg.model_type!r})")

    state = abstract
    for path, var in flat.items():
        _set_path(state, path, var.replace(values[path]) if hasattr(var, "replace") else values[path])
    return graphdef, state


def _read_checked(ckpt: Checkpoint, key: str, our_shape: tuple, transform: str, np_dtype) -> jax.Array:
    want = _to_hf_shape(our_shape, transform)
    got = ckpt.shape(key)
    if got != want:
        raise WeightsError(f"{ckpt.where[key]}: tensor {key!r} has shape {list(got)}, expected {list(want)}")
    src = ckpt.dtype(key)
    if src not in _FLOAT_SAFETENSORS:
        raise WeightsError(f"{ckpt.where[key]}: tensor {key!r} has dtype {src}, expected a float type")
    arr = ckpt.read(key)
    if transform == "linear":
        arr = arr.T
    return jnp.asarray(np.ascontiguousarray(arr, dtype=np_dtype))


# ---------------------------------------------------------------------------------------
# writing
def hf_tensors(cfg: TargetConfig, state) -> dict[str, np.ndarray]:
    """The state as Hugging Face tensors {key: numpy array [out, in]}, in its own dtype."""
    flat = _flat_params(state)
    out = {}
    for hf_key, ours, transform in key_map(cfg):
        var = flat[ours]
        arr = np.asarray(jax.device_get(var[...] if isinstance(var, nnx.Variable) else var))
        out[hf_key] = np.ascontiguousarray(arr.T if transform == "linear" else arr)
    return out


def _dtype_name(tensors: dict[str, np.ndarray]) -> str:
    kinds = {a.dtype for a in tensors.values()}
    return "bfloat16" if kinds == {np.dtype(ml_dtypes.bfloat16)} else "float32"


def export_target(
    cfg: TargetConfig,
    state,
    path: str | os.PathLike,
    *,
    overwrite: bool = False,
    extra_files: Iterable[str | os.PathLike] = (),
) -> Path:
    """Writes an HF folder (config.json + model.safetensors) that transformers loads.

    Written to a temporary folder beside `path`, then renamed into place. `extra_files`
    (e.g. tokenizer files) are copied in too. An existing `path` is replaced only with
    `overwrite=True`.
    """
    tensors = hf_tensors(cfg, state)
    config = cfg.to_hf()
    config["dtype"] = _dtype_name(tensors)
    return write_hf_folder(path, config, tensors, overwrite=overwrite, extra_files=list(extra_files))
