"""Hugging Face safetensors <-> Flax NNX parameters for the target families.

Driven by the family key maps (`peagle_jax.models.registry.key_map`, per layer restricted to
that layer's feed-forward kind by `target_rows`): one row per tensor, ``(hf_key, our_path,
transform)``, `transform` ``"linear"`` (PyTorch ``[out, in]`` weight <-> NNX kernel ``[in, out]``:
a transpose), ``"identity"`` (embeddings, norms, biases, GPT-OSS expert stacks) or
``"experts_linear"`` (Qwen3-MoE: ``{e}`` in the key runs over the experts, each ``[out, in]``
matrix is transposed and stacked into ``[E, in, out]``).

MXFP4 (the released GPT-OSS checkpoints): an expert stack ``<key>`` may be stored as
``<key>_blocks`` (uint8 [E, out, in/32, 16], two e2m1 values per byte, low nibble first) and
``<key>_scales`` (uint8 [E, out, in/32], e8m0 exponents with bias 127, one per group of 32);
it is dequantised to the compute dtype at load, exactly as transformers'
`convert_moe_packed_tensors` does (see docs/moe.md for the memory this costs).

Loading reads `model.safetensors` or a sharded `model.safetensors.index.json`, checks
that every tensor the model needs is there with the right shape, that every tensor in the
checkpoint is consumed (Hugging Face's non-parameter buffers such as ``rotary_emb.inv_freq``
are skipped; a tied model's duplicated ``lm_head.weight`` is accepted when it equals the
embedding) and fills an abstract model built with `nnx.eval_shape`, so the full model is
never randomly initialised. Errors are `WeightsError` and name the file and key.

Export writes ``config.json`` (`registry.hf_config`) and ``model.safetensors`` into a
temporary folder beside the destination, then renames it into place.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from peagle_jax.config.dtypes import numpy_dtype
from peagle_jax.config.target_config import TargetConfig
from peagle_jax.models.abstract import abstract_module
from peagle_jax.models.registry import hf_config, key_map
from peagle_jax.runtime.folders import INDEX_FILE, SINGLE_FILE, write_hf_folder

# the files of a target folder besides config.json and weights, copied with it on export
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)

# e2m1 code -> value (transformers.integrations.mxfp4.FP4_VALUES)
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
MXFP4_GROUP = 32
MXFP4_SCALE_BIAS = 127

# Hugging Face buffers that may appear in old checkpoints and are not parameters.
IGNORED_KEYS = (re.compile(r"(^|\.)rotary_emb\.(inv_freq|original_inv_freq)$"), re.compile(r"\.embed_scale$"))
_FLOAT_SAFETENSORS = {"F64", "F32", "F16", "BF16"}


class WeightsError(ValueError):
    """A checkpoint that cannot be used; the message names the file and key."""


TIED_LM_HEAD = "lm_head.weight"


def _to_hf_shape(shape: tuple, transform: str) -> tuple:
    return tuple(reversed(shape)) if transform == "linear" else tuple(shape)


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


def abstract_model(cfg: TargetConfig, dtype="float32"):
    """(graphdef, abstract state) of the target Decoder: shapes only, nothing allocated."""
    from peagle_jax.models.decoder import Decoder

    return abstract_module(Decoder, cfg, dtype)


def _flat_params(state) -> dict[tuple, object]:
    return {tuple(path): var for path, var in nnx.to_flat_state(state)}


def target_rows(cfg: TargetConfig) -> list[tuple[str, tuple, str]]:
    """`registry.key_map(cfg)` with, in each layer, only the feed-forward rows of that layer's kind
    (dense MLP or router + experts: Qwen3-MoE mixes them through `mlp_only_layers`)."""

    def applies(ours: tuple) -> bool:
        if len(ours) < 4 or ours[0] != "layers" or ours[2] != "mlp":
            return True
        return (ours[3] in ("router", "experts")) == cfg.is_moe_layer(ours[1])

    return [row for row in key_map(cfg) if applies(row[1])]


def expert_keys(hf_key: str, cfg: TargetConfig) -> list[str]:
    """The per-expert keys of an "experts_linear" row."""
    return [hf_key.format(e=e) for e in range(cfg.num_experts)]


def load_params(folder: str | os.PathLike, cfg: TargetConfig, dtype="float32"):
    """Reads the folder's safetensors into (graphdef, state) of the target Decoder.

    Every tensor of the key map must be present with its shape; every tensor of the
    checkpoint must be consumed. Values are cast to `dtype` (float32 or bfloat16); MXFP4
    expert stacks are dequantised to it.
    """
    np_dtype = numpy_dtype(dtype)
    ckpt = Checkpoint(folder)
    graphdef, abstract = abstract_model(cfg, np_dtype)
    flat = _flat_params(abstract)
    rows = target_rows(cfg)
    covered = {ours for _, ours, _ in rows}
    if covered != set(flat):  # the table and the module tree must agree (a bug, not bad input)
        raise AssertionError(f"key map / model mismatch: {sorted(set(flat) ^ covered)}")

    values: dict[tuple, jax.Array] = {}
    consumed = set()
    for hf_key, ours, transform in rows:
        if transform == "experts_linear":
            keys = expert_keys(hf_key, cfg)
            for key in keys:
                if key not in ckpt.where:
                    raise WeightsError(f"{ckpt.folder}: missing tensor {key!r} (model_type {cfg.model_type!r})")
            e, fin, fout = flat[ours].shape
            values[ours] = jnp.asarray(
                np.stack([np.asarray(_read_checked(ckpt, key, (fin, fout), "linear", np_dtype)) for key in keys])
            )
            consumed.update(keys)
        elif hf_key not in ckpt.where and f"{hf_key}_blocks" in ckpt.where:
            values[ours] = _read_mxfp4(ckpt, hf_key, flat[ours].shape, np_dtype)
            consumed.update((f"{hf_key}_blocks", f"{hf_key}_scales"))
        elif hf_key not in ckpt.where:
            raise WeightsError(f"{ckpt.folder}: missing tensor {hf_key!r} (model_type {cfg.model_type!r})")
        else:
            values[ours] = _read_checked(ckpt, hf_key, flat[ours].shape, transform, np_dtype)
            consumed.add(hf_key)

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

    return graphdef, nnx.from_flat_state([(path, var.replace(values[path])) for path, var in flat.items()])


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


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """MXFP4 blocks [..., R, G, 16] uint8 + scales [..., R, G] uint8 -> [..., G * 32, R] in `dtype`.

    transformers' `convert_moe_packed_tensors`: byte j of a group holds values 2j (low nibble)
    and 2j + 1 (high nibble), each an e2m1 code; the group's value is times 2**(scale - 127);
    the last two axes are then swapped (stored [out, in], used [in, out]). Exact in bfloat16.
    """
    blocks = np.asarray(blocks, np.uint8)
    exps = np.asarray(scales).astype(np.int32) - MXFP4_SCALE_BIAS
    vals = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)  # [..., R, G, 16, 2]
    vals = np.ldexp(vals.reshape(*blocks.shape[:-1], 2 * blocks.shape[-1]), exps[..., None])
    out = vals.reshape(*blocks.shape[:-2], -1)  # [..., R, G * 32]
    return np.ascontiguousarray(np.swapaxes(out, -1, -2)).astype(dtype)


def _read_mxfp4(ckpt: Checkpoint, key: str, our_shape: tuple, np_dtype) -> jax.Array:
    """The expert stack `key` [E, in, out] from `key`_blocks / `key`_scales (checked), one expert at a time."""
    bkey, skey = f"{key}_blocks", f"{key}_scales"
    if skey not in ckpt.where:
        raise WeightsError(f"{ckpt.where[bkey]}: MXFP4 tensor {bkey!r} has no {skey!r}")
    e, fin, fout = our_shape
    if fin % MXFP4_GROUP:
        raise WeightsError(
            f"{ckpt.where[bkey]}: MXFP4 tensor {bkey!r}: input width {fin} is not a multiple of {MXFP4_GROUP}"
        )
    groups = fin // MXFP4_GROUP
    for k, want in ((bkey, (e, fout, groups, MXFP4_GROUP // 2)), (skey, (e, fout, groups))):
        got = ckpt.shape(k)
        if got != want:
            raise WeightsError(f"{ckpt.where[k]}: MXFP4 tensor {k!r} has shape {list(got)}, expected {list(want)}")
        if ckpt.dtype(k) != "U8":
            raise WeightsError(f"{ckpt.where[k]}: MXFP4 tensor {k!r} has dtype {ckpt.dtype(k)}, expected U8")
    blocks, scales = ckpt.read(bkey), ckpt.read(skey)
    out = np.empty(our_shape, np_dtype)
    for i in range(e):  # one expert at a time: the float32 intermediate stays one expert large
        out[i] = dequantize_mxfp4(blocks[i], scales[i], np_dtype)
    return jnp.asarray(out)


# ---------------------------------------------------------------------------------------
# writing
def target_tensors(cfg: TargetConfig, state) -> dict[str, np.ndarray]:
    """The state as Hugging Face tensors {key: numpy array [out, in]}, in its own dtype."""
    flat = _flat_params(state)
    out = {}
    for hf_key, ours, transform in target_rows(cfg):
        var = flat[ours]
        arr = np.asarray(jax.device_get(var[...] if isinstance(var, nnx.Variable) else var))
        if transform == "experts_linear":
            for e, key in enumerate(expert_keys(hf_key, cfg)):
                out[key] = np.ascontiguousarray(arr[e].T)
            continue
        out[hf_key] = np.ascontiguousarray(arr.T if transform == "linear" else arr)
    return out


def tensors_dtype_name(tensors: dict[str, np.ndarray]) -> str:
    """The `dtype` a config.json records for these tensors: bfloat16 when all are, else float32."""
    kinds = {a.dtype for a in tensors.values()}
    return "bfloat16" if kinds == {numpy_dtype("bfloat16")} else "float32"


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
    tensors = target_tensors(cfg, state)
    config = hf_config(cfg)
    config["dtype"] = tensors_dtype_name(tensors)
    return write_hf_folder(path, config, tensors, overwrite=overwrite, extra_files=list(extra_files))
