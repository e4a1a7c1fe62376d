"""A speculators-format head with sliding-window layers, written by hand as speculators 0.9.0
writes one (`transformer_layer_config` with `layer_types`, `sliding_window`,
`use_sliding_window`; bf16 tensors under `layers.{i}.*`): it imports, decodes losslessly
(greedy outputs equal plain greedy decoding of the target), exports back bit-exactly (tensors
byte for byte, the window keys as written, a second round trip identical), the vLLM export
carries the keys vLLM reads (`layer_types`, `sliding_window`), the lint reports the window, and
malformed window keys raise errors naming the file and the key."""

from __future__ import annotations

import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from infer import SpeculativeDecoder
from peagle_jax.config.target_config import ConfigError, TargetConfig
from peagle_jax.formats import export_speculators, export_vllm, inspect_folder, read_speculators_config
from peagle_jax.handles.drafter import load_drafter, new_drafter
from peagle_jax.handles.target import Target
from peagle_jax.models.decoder import Decoder

AUX, WINDOW, VD, INTER, NEW = [0, 1, 2], 4, 48, 80, 16
VOCAB, HIDDEN, HEADS, HEAD_DIM = 96, 64, 4, 16
LAYER_TYPES = ["full_attention", "sliding_attention"]
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def target():
    """A tiny random Llama target (the head's aux layers 0, 1, 2)."""
    cfg = TargetConfig("llama", VOCAB, HIDDEN, 96, 3, HEADS, 2, HEAD_DIM, max_position_embeddings=128)
    graphdef, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    return Target(cfg, graphdef, state, aux_layer_ids=AUX)


def speculators_config(kind="peagle", **layer_extra) -> dict:
    """config.json as speculators 0.9.0 writes it (the keys its PEagle / Eagle3 configs hold)."""
    layer = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": len(LAYER_TYPES),
        "num_attention_heads": HEADS,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 128,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_bias": False,
        "mlp_bias": False,
        "head_dim": HEAD_DIM,
        "sliding_window": WINDOW,
        "use_sliding_window": True,
        "layer_types": LAYER_TYPES,
        "model_type": "llama",
        **layer_extra,
    }
    cfg = {
        "architectures": ["PEagleSpeculator" if kind == "peagle" else "Eagle3Speculator"],
        "speculators_model_type": kind,
        "speculators_version": "0.9.0",
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny/llama", "architectures": ["LlamaForCausalLM"]},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": VD,
        "norm_before_residual": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": AUX,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": True,
    }
    if kind == "peagle":
        cfg["mask_token_id"] = VOCAB - 1
    return cfg


def speculators_tensors(kind="peagle", seed=0) -> dict:
    """Every tensor of the head, keys spelled out (bf16; d2t int64 and t2d bool: Vd < V)."""
    rng = np.random.default_rng(seed)
    h, v, hd = HIDDEN, VOCAB, HEAD_DIM

    def r(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale or shape[-1] ** -0.5)).astype(BF16)

    t = {"embed_tokens.weight": r(v, h, scale=1.0), "fc.weight": r(h, 3 * h), "norm.weight": 1 + r(h, scale=0.2)}
    t["lm_head.weight"] = r(VD, h)
    for i in range(len(LAYER_TYPES)):
        p, width = f"layers.{i}.", 2 * h if i == 0 else h
        t.update(
            {
                p + "input_layernorm.weight": 1 + r(h, scale=0.2),
                p + "post_attention_layernorm.weight": 1 + r(h, scale=0.2),
                p + "self_attn.q_proj.weight": r(HEADS * hd, width),
                p + "self_attn.k_proj.weight": r(2 * hd, width),
                p + "self_attn.v_proj.weight": r(2 * hd, width),
                p + "self_attn.o_proj.weight": r(h, HEADS * hd),
                p + "mlp.gate_proj.weight": r(INTER, h),
                p + "mlp.up_proj.weight": r(INTER, h),
                p + "mlp.down_proj.weight": r(h, INTER),
            }
        )
    t["layers.0.hidden_norm.weight"] = 1 + r(h, scale=0.2)
    used = np.sort(rng.choice(v, VD, replace=False))
    t["d2t"] = (used - np.arange(VD)).astype(np.int64)
    t["t2d"] = np.isin(np.arange(v), used)
    if kind == "peagle":
        t["mask_hidden"] = r(1, 1, 3 * h, scale=1.0)
    return {k: np.ascontiguousarray(x) for k, x in t.items()}


def write(folder: Path, config: dict, tensors: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def prompts(n=3, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(m)).tolist() for m in rng.integers(6, 13, n)]


# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["peagle", "eagle3"])
def test_windowed_speculators_head_decodes_losslessly(kind, target, tmp_path):
    """Both modes over the engine: one pass of K mask slots, or K chain steps whose window
    (checked step by step against a dense reference in tests/test_drafter_window.py) slides
    over the drafter's cache as the round goes."""
    src = write(tmp_path / kind, speculators_config(kind), speculators_tensors(kind))
    d = load_drafter(src)
    c = d.config
    assert c.layer_types == tuple(LAYER_TYPES)
    assert c.sliding_window == WINDOW
    assert c.window(1) == WINDOW
    assert [layer.self_attn.window for layer in d.model.layers] == [None, WINDOW]
    mode = "parallel" if kind == "peagle" else "chain"
    assert c.mode == mode
    ps = prompts()
    plain = SpeculativeDecoder(target, mode="none").generate(ps, max_new_tokens=NEW)
    # K = 5 > the window: the mask slots' window cuts into the real prefix and the chain
    res = SpeculativeDecoder(target, d, k=5, mode=mode).generate(ps, max_new_tokens=NEW)
    assert res.tokens == plain.tokens
    assert 1.0 <= res.stats["acceptance_length"] <= 6


@pytest.mark.parametrize("kind", ["peagle", "eagle3"])
def test_windowed_head_exports_back_bit_exactly(kind, tmp_path):
    raw, tensors = speculators_config(kind), speculators_tensors(kind)
    src = write(tmp_path / "src", raw, tensors)
    d = load_drafter(src)
    assert d.config.mode == ("parallel" if kind == "peagle" else "chain")
    out = export_speculators(d, tmp_path / "spec")  # bf16, as the source
    back_tensors = load_file(str(out / "model.safetensors"))
    assert sorted(back_tensors) == sorted(tensors)
    for key, want in tensors.items():
        got = back_tensors[key]
        assert got.dtype == want.dtype, key
        assert got.shape == want.shape, key
        assert got.tobytes() == want.tobytes(), key
    cfg = json.loads((out / "config.json").read_text())
    layer = cfg["transformer_layer_config"]
    for key in ("layer_types", "sliding_window", "use_sliding_window"):
        assert layer[key] == raw["transformer_layer_config"][key], key
    assert load_drafter(out).config == d.config
    # a second round trip is byte-identical (config and tensors)
    again = export_speculators(load_drafter(out), tmp_path / "spec2")
    for name in ("config.json", "model.safetensors"):
        assert (again / name).read_bytes() == (out / name).read_bytes(), name
    # the vLLM-native export: the keys vLLM's Llama attention reads per draft layer
    vllm = export_vllm(d, tmp_path / "vllm")
    vcfg = json.loads((vllm / "config.json").read_text())
    assert vcfg["layer_types"] == LAYER_TYPES
    assert vcfg["sliding_window"] == WINDOW
    back = load_drafter(vllm)
    assert back.config == d.config
    vt = load_file(str(vllm / "model.safetensors"))
    assert vt["midlayer.self_attn.q_proj.weight"].tobytes() == tensors["layers.0.self_attn.q_proj.weight"].tobytes()
    # the lint reports the window; K 5 > window 4 is a warning (training and vLLM differ at depth >= 4)
    report = inspect_folder(src)
    assert report["sliding_layers"] == [1]
    assert report["sliding_window"] == WINDOW
    assert not report["problems"], report["problems"]
    assert any("sliding window of 4 tokens" in n for n in report["notes"])
    assert any("sliding_window 4 < trained depth K 5" in w for w in report["warnings"])


@pytest.mark.parametrize(
    "layer_extra,message",
    [
        (dict(layer_types=["sliding_attention"] * 3), "key 'layer_types' has 3 entries, but num_hidden_layers is 2"),
        (dict(layer_types=["full_attention", "chunked"]), "key 'layer_types' has unknown entries \\['chunked'\\]"),
        (dict(layer_types="sliding_attention"), "key 'layer_types' must be a list of strings"),
        (dict(sliding_window=0), "key 'sliding_window' has invalid value 0 \\(an int >= 1\\)"),
        (dict(sliding_window=None), "key 'layer_types' names sliding_attention layers but 'sliding_window' is not set"),
        (dict(layer_types=None), "key 'use_sliding_window' is True but 'layer_types' names none"),
        (dict(use_sliding_window=False), "key 'use_sliding_window' is False but 'layer_types' names sliding"),
    ],
)
def test_bad_window_keys_name_the_file_and_key(layer_extra, message, tmp_path):
    where = str(tmp_path / "config.json")
    with pytest.raises(ConfigError, match=re.escape(f"{where} key 'transformer_layer_config': ") + message):
        read_speculators_config(speculators_config(**layer_extra), where)
    folder = write(tmp_path / "bad", speculators_config(**layer_extra), speculators_tensors())
    assert any(message.replace("\\", "") in p for p in inspect_folder(folder)["problems"])


def test_window_keys_are_optional():
    """Written by speculators for a head whose layers are all full: no window anywhere."""
    c = read_speculators_config(speculators_config(layer_types=["full_attention"] * 2, use_sliding_window=False), "x")
    assert not c.sliding
    assert c.sliding_window == WINDOW
    assert c.window(0) is None
    tl = speculators_config()["transformer_layer_config"]
    plain = {k: v for k, v in tl.items() if k not in ("layer_types", "sliding_window", "use_sliding_window")}
    c = read_speculators_config({**speculators_config(), "transformer_layer_config": plain}, "x")
    assert c.layer_types == ("full_attention",) * 2
    assert c.sliding_window is None


def test_new_drafter_takes_a_window(target):
    c = new_drafter(target, num_layers=2, sliding_window=8).config
    assert c.layer_types == ("sliding_attention",) * 2
    assert c.window(1) == 8  # speculators' default: all slide
    c = new_drafter(target, num_layers=2, sliding_window=8, layer_types=LAYER_TYPES).config
    assert [c.window(i) for i in range(2)] == [None, 8]
    assert not new_drafter(target, num_layers=2).config.sliding
