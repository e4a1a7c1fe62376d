"""Drafter checkpoint formats on (DrafterConfig, {path: array}) (docs/method.md section 6).

Our own checkpoint (`drafter.json` + orbax `state/`) and two layouts of other tools, both
`config.json` + `model.safetensors` (or a sharded index) with flat keys:
- vLLM native (`architectures: ["LlamaForCausalLMEagle3"]`, model_type llama): layer 0 as
  `midlayer.*` (or `layers.0.*`), later layers `layers.{i}.*`; the mask id under
  `mask_token_id` / `pard_token` / `ptd_token_id`; aux ids top level or in `eagle_config`.
- speculators (`speculators_model_type: "peagle"` or `"eagle3"`): the layer shape in
  `transformer_layer_config`, weights under `layers.{i}.*`.
Their config.json files are read by `peagle_jax.head_config` and written by
`peagle_jax.head_config_write` (both re-exported here).

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
- A full-vocabulary head (Vd == V) carries no d2t/t2d: vLLM 0.33 then creates no
  `draft_id_to_target_id` parameter and refuses a checkpoint that has one. A reduced head must.
- `norm_output` (EAGLE 3.1): chain mode feeds the post-norm state back (`DrafterModel.feedback`).
- Sliding-window layers: `layer_types`, `sliding_window` and `use_sliding_window` in the layer
  config (`transformer_layer_config`; the top level of a vLLM-native config), as speculators
  writes them and vLLM reads them (`head_config.layer_windows`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import numpy as np

from peagle_jax.config import NUM_AUX, ConfigError, DrafterConfig, default_aux_layer_ids, read_json
from peagle_jax.dtypes import EXPORT, dtype_name, numpy_dtype
from peagle_jax.folders import CONFIG_FILE, SINGLE_FILE, atomic_folder, check_destination, write_hf_folder
from peagle_jax.head_config import head_facts, read_speculators_config, read_vllm_config
from peagle_jax.head_config_write import speculators_config, vllm_config
from peagle_jax.models.drafter import abstract_drafter, check_d2t, flat_state, state_from_arrays, t2d_from_d2t
from peagle_jax.serving import resolve_verifier, target_facts

__all__ = [
    "DrafterIOError",
    "detect_format",
    "read_drafter",
    "read_own",
    "write_own",
    "OWN_CONFIG_FILE",
    "read_vllm_config",
    "read_speculators_config",
    "vllm_config",
    "speculators_config",
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

OWN_CONFIG_FILE = "drafter.json"
OWN_STATE_DIR = "state"
OWN_FORMAT = "peagle_jax.drafter"
OWN_VERSION = 1
LAYER0, MIDLAYER = "layers.0.", "midlayer."
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # safetensors header names


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
    return key != "d2t" or cfg.draft_vocab_size < cfg.vocab_size


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


def read_drafter(path: str | os.PathLike, *, embeddings=None) -> tuple[DrafterConfig, dict, str]:
    """(config, {path: array}, dtype) of a drafter folder in any format: our checkpoint,
    vLLM-native or speculators. dtype: the one a handle should hold the arrays in (our
    checkpoint: as saved; imports: "float32", exact for bf16 / f16 files); imported float
    arrays keep the file's dtype. `embeddings`: a callable giving the target's [V, H] input
    embeddings, used only for an EAGLE-3 chain head that ships no embed_tokens."""
    folder = Path(path)
    fmt = detect_format(folder)
    if fmt == "own":
        return read_own(folder)
    where = str(folder / CONFIG_FILE)
    raw = read_json(folder / CONFIG_FILE)
    if fmt == "speculators":
        config = _verifier_aux_ids(read_speculators_config(raw, where), folder)
    else:
        config = read_vllm_config(raw, where)
    return config, _read_tensors(folder, config, embeddings), "float32"


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
    """Checks `ckpt` (a `peagle_jax.weights.Checkpoint`) against `config`'s tensor table; the one
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


def _read_tensors(folder: Path, config: DrafterConfig, embeddings) -> dict[tuple, np.ndarray]:
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
    for name, ours, transform, want in chk.rows:
        if name not in ckpt.where:
            out[ours] = _missing(folder, config, name, want, embeddings)
        elif transform == "d2t":
            out[ours] = read_id_map(ckpt, config)
        else:  # checked: a float tensor of the right size
            arr = _read(ckpt, name)
            arr = arr.reshape(want) if transform == "mask" else arr
            out[ours] = np.ascontiguousarray(arr.T) if transform == "linear" else arr
    return out


def read_id_map(ckpt, config: DrafterConfig) -> np.ndarray:
    """A checkpoint's d2t [Vd] as int32, checked (an integer type, its shape, one-to-one into
    [0, V)) together with its t2d when it has one. DrafterIOError naming the file and tensor.
    `ckpt`: a `peagle_jax.weights.Checkpoint`."""
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


def _missing(folder: Path, config: DrafterConfig, key: str, want: tuple, embeddings) -> np.ndarray:
    f = folder / SINGLE_FILE if (folder / SINGLE_FILE).exists() else folder
    if key == "d2t" and not _needs_tensor(config, key):
        return np.zeros(want, np.int32)  # full vocabulary: identity map
    if key == "embed_tokens.weight":
        if embeddings is not None and config.mode == "chain":
            emb = embeddings()
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
    """`checkpoint_tensors` in vLLM's native layout: layer 0 as `midlayer.*`."""
    return checkpoint_tensors(config, arrays, dtype, MIDLAYER)


def speculators_tensors(config: DrafterConfig, arrays: dict, dtype="bfloat16") -> dict[str, np.ndarray]:
    """`checkpoint_tensors` in the speculators layout: layer 0 as `layers.0.*`."""
    return checkpoint_tensors(config, arrays, dtype, LAYER0)


def export_vllm(head, out: str | os.PathLike, dtype="bfloat16", *, overwrite: bool = False) -> Path:
    """vLLM-native folder of `head` (anything with `.config` and `.arrays()`, e.g. a Drafter):
    `midlayer.*`, mask id under all three keys. Serve it with the command
    `peagle_jax.inspect.serve_command` prints."""
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


# ---------------------------------------------------------------------------------------
# our own checkpoint: drafter.json (config) + state/ (orbax)


def local_checkpointer():
    """An orbax checkpointer for this process alone: a head folder is written and read by one
    process, also inside a multi-host run (orbax's default waits for every process)."""
    import jax
    import orbax.checkpoint as ocp

    if jax.process_count() == 1:
        return ocp.StandardCheckpointer()
    me = jax.process_index()
    opts = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"p{me}")
    return ocp.StandardCheckpointer(multiprocessing_options=opts)


def write_own(path: str | os.PathLike, config: DrafterConfig, arrays: dict, dtype="float32") -> Path:
    """Our checkpoint, written to a temporary sibling folder and renamed into place; an
    existing drafter checkpoint (or empty folder) at `path` is replaced, anything else refused."""
    import jax
    from flax import nnx

    dest = Path(path).absolute()
    check_destination(dest, overwrite=True, marker=OWN_CONFIG_FILE)  # replaces only a drafter checkpoint
    _, state = state_from_arrays(config, arrays, dtype)
    with atomic_folder(dest) as tmp:
        meta = {"format": OWN_FORMAT, "version": OWN_VERSION, "dtype": dtype_name(dtype), "config": config.to_dict()}
        (tmp / OWN_CONFIG_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        with local_checkpointer() as ckptr:
            tree = nnx.to_pure_dict(state)
            if jax.process_count() > 1:  # orbax refuses process-local jax.Arrays in a multi-host run
                tree = jax.tree.map(np.asarray, tree)
            ckptr.save(tmp / OWN_STATE_DIR, tree)
            ckptr.wait_until_finished()
    return dest


def read_own(path: Path) -> tuple[DrafterConfig, dict, str]:
    from flax import nnx

    cfg_file = path / OWN_CONFIG_FILE
    meta = read_json(cfg_file)
    if meta.get("format") != OWN_FORMAT:
        raise ConfigError(f"{cfg_file}: key 'format' is {meta.get('format')!r}, expected {OWN_FORMAT!r}")
    if meta.get("version") != OWN_VERSION:
        raise ConfigError(f"{cfg_file}: unsupported version {meta.get('version')!r} (this build reads {OWN_VERSION})")
    config = DrafterConfig.from_dict(meta.get("config") or {}, f"{cfg_file} key 'config'")
    stored = dtype_name(meta.get("dtype", "float32"))
    state_dir = path / OWN_STATE_DIR
    if not state_dir.is_dir():
        raise FileNotFoundError(f"{state_dir}: missing (a drafter checkpoint holds drafter.json and state/)")
    _, abstract = abstract_drafter(config, stored)
    with local_checkpointer() as ckptr:
        try:
            restored = ckptr.restore(state_dir.absolute(), nnx.to_pure_dict(abstract))
        except Exception as err:  # orbax raises many types; name the folder
            raise ValueError(f"{state_dir}: cannot restore the drafter state ({err})") from None
    arrays = {
        tuple(int(k) if isinstance(k, str) and k.isdigit() else k for k in p): np.asarray(v)
        for p, v in _flatten(restored)
    }
    return config, arrays, stored


def _flatten(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, prefix + (k,))
    else:
        yield prefix, tree
