"""A head with the configuration and shapes of the released amazon/GPT-OSS-20B-P-EAGLE (random bf16
weights built on the fly, keys spelled literally in vLLM's native layout): import -> export (vLLM
and speculators) -> import is bit-exact, the vLLM export holds the released file's tensors byte for
byte, and `inspect` finds no problem in either export.

Shapes (docs/method.md section 6 and the model card): 4 layers, hidden 2880 = target hidden,
fc 8640 -> 2880, mask_hidden [1, 1, 8640], full vocabulary 201088 (no d2t / t2d), 64 heads, 8 KV
heads, head_dim 64, llama3 rope, K_train 10. The intermediate size is not public; 7680 is assumed
(the card's 1.8B parameters would suggest about 14336).
"""

from __future__ import annotations

import dataclasses
import json
import resource
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from peagle_jax.config.drafter_config import DrafterConfig
from peagle_jax.config.target_config import RopeConfig
from peagle_jax.formats import export_speculators, export_vllm, inspect_folder, read_drafter

BF16 = np.dtype(ml_dtypes.bfloat16)
V, H, LAYERS, HEADS, KV, HD, INTER = 201088, 2880, 4, 64, 8, 64, 7680
MASK_ID, AUX = 199999, [2, 12, 21]  # GPT-OSS's pad token; vLLM's default ids for its 24 layers
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def released_config() -> dict:
    """config.json as the released head spells it (vLLM native, no peagle_jax fields)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HD,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3,
        "max_position_embeddings": 131072,
        "vocab_size": V,
        "draft_vocab_size": V,
        "target_hidden_size": H,
        "tie_word_embeddings": False,
        "norm_before_residual": False,
        "hidden_act": "silu",
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": AUX},
        "eagle_aux_hidden_state_layer_ids": AUX,
        "mask_token_id": MASK_ID,
        "pard_token": MASK_ID,
        "ptd_token_id": MASK_ID,
        "torch_dtype": "bfloat16",
    }


def random_bf16(rng, *shape) -> np.ndarray:
    """Finite bf16 values of magnitude in [2**-7, 1), random sign, drawn as bits in chunks
    (no float32 copy of the [201088, 2880] matrices)."""
    out = np.empty(shape, np.uint16)
    flat = out.reshape(-1)
    for i in range(0, flat.size, 1 << 24):
        n = min(1 << 24, flat.size - i)
        flat[i : i + n] = rng.integers(0x3C00, 0x3F80, n, dtype=np.uint16) | (
            rng.integers(0, 2, n, dtype=np.uint16) << 15
        )
    return out.view(BF16)


def released_tensors(seed=0) -> dict[str, np.ndarray]:
    """Every tensor of the released layout, keys written out (midlayer.* for layer 0)."""
    rng = np.random.default_rng(seed)
    t = {
        "embed_tokens.weight": random_bf16(rng, V, H),
        "fc.weight": random_bf16(rng, H, 3 * H),
        "norm.weight": random_bf16(rng, H),
        "lm_head.weight": random_bf16(rng, V, H),
        "mask_hidden": random_bf16(rng, 1, 1, 3 * H),
    }
    for i in range(LAYERS):
        p, din = ("midlayer.", 2 * H) if i == 0 else (f"layers.{i}.", H)
        for n in ["input_layernorm", "post_attention_layernorm"] + (["hidden_norm"] if i == 0 else []):
            t[f"{p}{n}.weight"] = random_bf16(rng, H)
        for name, rows, cols in (
            ("q", HEADS * HD, din),
            ("k", KV * HD, din),
            ("v", KV * HD, din),
            ("o", H, HEADS * HD),
        ):
            t[f"{p}self_attn.{name}_proj.weight"] = random_bf16(rng, rows, cols)
        for name, rows, cols in (("gate", INTER, H), ("up", INTER, H), ("down", H, INTER)):
            t[f"{p}mlp.{name}_proj.weight"] = random_bf16(rng, rows, cols)
    return t


def same_file(a: Path, b: Path, chunk: int = 1 << 26) -> bool:
    """Byte-equal files, read in chunks (no mmap of two 3 GB files)."""
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(chunk), fb.read(chunk)
            if x != y:
                return False
            if not x:
                return True


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(np.array_equal(a.view(np.uint16), b.view(np.uint16)) if a.dtype == BF16 else np.array_equal(a, b))


@pytest.mark.slow
def test_released_gpt_oss_20b_head_round_trips(tmp_path):
    """Measured on the shared 2-core CPU box, this test alone: 145-220 s wall (by load), peak RSS
    10.1 GB = 7.0 GB anonymous (one bf16 copy of the head is 3.1 GB: at most two live at once, plus
    a tensor's transpose) + 3.1 GB of the importer's memory-mapped safetensors file."""
    start = time.perf_counter()
    src = tmp_path / "released"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(released_config()))
    tensors = released_tensors()
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    try:
        config, arrays, _ = read_drafter(src)
        assert config == DrafterConfig(
            hidden_size=H,
            target_hidden_size=H,
            num_layers=LAYERS,
            num_heads=HEADS,
            num_kv_heads=KV,
            head_dim=HD,
            intermediate_size=INTER,
            vocab_size=V,
            draft_vocab_size=V,
            rms_norm_eps=1e-5,
            rope=RopeConfig(500000.0, "llama3", 8.0, 1.0, 4.0, 8192),
            max_position_embeddings=131072,
            mode="parallel",
            mask_token_id=MASK_ID,
            aux_layer_ids=tuple(AUX),
        )
        assert {a.dtype for p, a in arrays.items() if p != ("d2t",)} == {BF16}  # no float32 copy
        assert not arrays[("d2t",)].any()
        # what the model card says and the config does not: K_train, the target
        config = dataclasses.replace(config, k_train=10, target_model_type="gpt_oss", verifier="openai/gpt-oss-20b")
        head = SimpleNamespace(config=config, arrays=lambda: arrays)
        out = {"vllm": export_vllm(head, tmp_path / "vllm"), "speculators": export_speculators(head, tmp_path / "spec")}
        # the released layout (no d2t / t2d), byte for byte: safetensors orders tensors itself
        assert same_file(src / "model.safetensors", out["vllm"] / "model.safetensors")
        for fmt, folder in out.items():
            report = inspect_folder(folder)
            assert report["problems"] == [], (fmt, report["problems"])
            assert report["mode"] == "parallel", (fmt, report["problems"])
            spec = json.loads(report["serve"].split("'")[1])
            assert spec["num_speculative_tokens"] == 7
            assert spec["parallel_drafting"] is True
            back, back_arrays, _ = read_drafter(folder)
            assert back == config, fmt
            assert set(back_arrays) == set(arrays), fmt
            assert all(same_bits(arrays[k], back_arrays[k]) for k in arrays), fmt
            del back_arrays
            shutil.rmtree(folder)
    finally:
        shutil.rmtree(src, ignore_errors=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"\n[released head] {time.perf_counter() - start:.0f} s, peak RSS {rss:.1f} GB")


def test_released_config_reads_without_weights():
    """The fast part: the released config.json alone gives the expected head (no 3 GB build)."""
    from peagle_jax.formats import read_vllm_config

    c = read_vllm_config(released_config(), "released/config.json")
    assert (c.fc_in, c.draft_vocab_size, c.mode, c.aux_layer_ids, c.rope.type) == (
        3 * H,
        V,
        "parallel",
        (2, 12, 21),
        "llama3",
    )
