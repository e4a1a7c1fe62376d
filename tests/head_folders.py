"""Drafter folders for the converter and lint tests: random heads in our format, and vLLM /
speculators folders written by hand (keys spelled literally, as docs/method.md section 6
lists them, independent of peagle_jax's key table). Tiny shapes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from peagle_jax.config.drafter_config import DrafterConfig
from peagle_jax.formats.convert import INDEX_FILE, main
from peagle_jax.handles.drafter import Drafter
from peagle_jax.models.eagle import abstract_drafter, flat_state

V, H, L_DRAFT = 64, 32, 2
HEADS, KV, HD, INTER = 4, 2, 8, 48
MASK_KEYS = ("mask_token_id", "pard_token", "ptd_token_id")
BF16 = np.dtype(ml_dtypes.bfloat16)


def random_drafter(num_layers=L_DRAFT, vd=40, mode="parallel", seed=0, **kw) -> Drafter:
    base = dict(
        hidden_size=H,
        target_hidden_size=H,
        num_layers=num_layers,
        num_heads=HEADS,
        num_kv_heads=KV,
        head_dim=HD,
        intermediate_size=INTER,
        vocab_size=V,
        draft_vocab_size=vd,
        max_position_embeddings=64,
        mode=mode,
        mask_token_id=V - 3 if mode == "parallel" else None,
        aux_layer_ids=(1, 3, 5),
        k_train=6,
        target_model_type="llama",
        verifier=None,
    )
    base.update(kw)
    cfg = DrafterConfig(**base)
    rng = np.random.default_rng(seed)
    arrays = {}
    for path, var in flat_state(abstract_drafter(cfg)[1]).items():
        if path == ("d2t",):
            used = np.sort(rng.choice(V, vd, replace=False)) if vd < V else np.arange(V)
            arrays[path] = (used - np.arange(vd)).astype(np.int32)
        else:
            arrays[path] = rng.standard_normal(var.shape).astype(np.float32)
    return Drafter.from_arrays(cfg, arrays)


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    return lines[0]


def listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def same_arrays(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=str(k))


def folder_tensors(folder: Path) -> dict[str, np.ndarray]:
    index = folder / INDEX_FILE
    if index.exists():
        out = {}
        for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            out.update(load_file(str(folder / name)))
        return out
    return load_file(str(folder / "model.safetensors"))


def bf16_round(arrays: dict) -> dict:
    return {k: v if v.dtype.kind == "i" else v.astype(BF16).astype(np.float32) for k, v in arrays.items()}


def write_target_config(folder: Path, **kw) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=H,
        num_hidden_layers=8,
        vocab_size=V,
        max_position_embeddings=4096,
        intermediate_size=64,
        num_attention_heads=4,
    )
    cfg.update(kw)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def hand_tensors(
    *,
    layer0="midlayer.",
    num_layers=2,
    bias=False,
    vd=V,
    ht=H,
    n_aux=3,
    seed=0,
    dtype=np.float32,
    mask_hidden=True,
    embed=True,
    qk_norm=False,
):
    rng = np.random.default_rng(seed)

    def r(*shape):
        return rng.standard_normal(shape).astype(dtype)

    t = {"fc.weight": r(H, n_aux * ht), "norm.weight": r(H), "lm_head.weight": r(vd, H)}
    if embed:
        t["embed_tokens.weight"] = r(V, H)
    if mask_hidden:
        t["mask_hidden"] = r(1, 1, n_aux * ht)
    if vd < V:
        used = np.sort(rng.choice(V, vd, replace=False))
        t["d2t"] = used - np.arange(vd, dtype=np.int64)
        t["t2d"] = np.zeros(V, bool)
        t["t2d"][used] = True
    for i in range(num_layers):
        p = layer0 if i == 0 else f"layers.{i}."
        din = 2 * H if i == 0 else H
        t[p + "input_layernorm.weight"] = r(H)
        t[p + "post_attention_layernorm.weight"] = r(H)
        if i == 0:
            t[p + "hidden_norm.weight"] = r(H)
        for name, rows, cols in (
            ("q", HEADS * HD, din),
            ("k", KV * HD, din),
            ("v", KV * HD, din),
            ("o", H, HEADS * HD),
        ):
            t[f"{p}self_attn.{name}_proj.weight"] = r(rows, cols)
            if bias:
                t[f"{p}self_attn.{name}_proj.bias"] = r(rows)
        if qk_norm:
            t[p + "self_attn.q_norm.weight"] = r(HD)
            t[p + "self_attn.k_norm.weight"] = r(HD)
        t[p + "mlp.gate_proj.weight"] = r(INTER, H)
        t[p + "mlp.up_proj.weight"] = r(INTER, H)
        t[p + "mlp.down_proj.weight"] = r(H, INTER)
    return t


def llama_fields(num_layers=2, **kw):
    out = dict(
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=num_layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=HD,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        vocab_size=V,
        hidden_act="silu",
        tie_word_embeddings=False,
    )
    out.update(kw)
    return out


def vllm_config(num_layers=2, vd=V, ht=H, mask_keys=MASK_KEYS, mask_id=V - 3, aux=(1, 3, 5), aux_where="both", **kw):
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **llama_fields(num_layers),
        "draft_vocab_size": vd,
        "target_hidden_size": ht,
        "eagle_config": {"use_aux_hidden_state": True},
    }
    if aux is not None:
        if aux_where in ("both", "top"):
            cfg["eagle_aux_hidden_state_layer_ids"] = list(aux)
        if aux_where in ("both", "inner"):
            cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(aux)
    for k in mask_keys:
        cfg[k] = mask_id
    cfg.update(kw)
    return cfg


def speculators_cfg(kind="peagle", num_layers=2, vd=V, mask_id=V - 3, verifier="org/target", tl_type="llama", **kw):
    cfg = {
        "architectures": ["PEagleDraftModel" if kind == "peagle" else "Eagle3DraftModel"],
        "speculators_model_type": kind,
        "speculators_version": "0.9.0",
        "transformer_layer_config": {"model_type": tl_type, **llama_fields(num_layers)},
        "draft_vocab_size": vd,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [1, 3, 5],
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
    }
    if kind == "peagle":
        cfg["mask_token_id"] = mask_id
    cfg.update(kw)
    return cfg


def write_folder(folder: Path, config: dict, tensors: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


_LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "fc", "lm_head"}


def expected_state(tensors: dict) -> dict:
    """Our state path -> value, derived from the checkpoint key alone ([out, in] -> kernel [in, out])."""
    out = {}
    for key, arr in tensors.items():
        if key == "t2d":
            continue
        parts = tuple(int(p) if p.isdigit() else p for p in key.replace("midlayer.", "layers.0.").split("."))
        arr = np.asarray(arr)
        if key == "d2t":
            out[parts] = arr.astype(np.int32)
        elif key == "mask_hidden":
            out[parts] = arr.astype(np.float32)
        elif parts[-1] == "weight" and parts[-2] in _LINEAR:
            out[parts[:-1] + ("kernel",)] = arr.T.astype(np.float32)
        elif parts[-2] == "embed_tokens":
            out[parts[:-1] + ("embedding",)] = arr.astype(np.float32)
        else:
            out[parts] = arr.astype(np.float32)
    return out
