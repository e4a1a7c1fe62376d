"""Tiny random Hugging Face models built offline, for parity tests (torch CPU, float32).

`build(kind, folder)` writes a `save_pretrained` folder and returns the torch model (eval,
f32, eager attention). Norm weights are randomised too, so a (1 + w) vs w mix-up shows.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VOCAB, HIDDEN, INTER, LAYERS, HEADS, HEAD_DIM = 96, 64, 80, 3, 4, 16
GEMMA_WINDOW = 5
GPT_OSS_WINDOW = 4
EXPERTS, TOP_K, MOE_INTER = 8, 3, 32  # several experts per token, all of them used (tests/test_moe.py)
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=8.0,
    beta_fast=32.0,
    beta_slow=1.0,
    original_max_position_embeddings=64,
    truncate=False,
)

# name -> (family, overrides)
SPECS = {
    "llama-mha-untied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "llama-gqa2-tied-llama3": (
        "llama",
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "llama-gqa4-untied-linear": (
        "llama",
        dict(
            num_key_value_heads=1,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=4.0),
        ),
    ),
    "llama-bias": ("llama", dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True)),
    "qwen3": ("qwen3", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "gemma3": (
        "gemma3",
        dict(
            num_key_value_heads=2,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=GEMMA_WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=4.0,
            rope_parameters={
                "full_attention": dict(rope_type="linear", rope_theta=1e6, factor=2.0),
                "sliding_attention": dict(rope_type="default", rope_theta=1e4),
            },
        ),
    ),
    # MoE families: a dense layer among sparse ones (mlp_only_layers), softmax-then-top-k routing
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            num_key_value_heads=2,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=MOE_INTER,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    # sinks, biases, sliding window 4 on even layers, yarn, top-k-then-softmax routing; a low swiglu
    # limit so the clamps bind on these small activations; intermediate_size is the expert width
    "gpt_oss": (
        "gpt_oss",
        dict(
            num_key_value_heads=2,
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            intermediate_size=MOE_INTER,
            sliding_window=GPT_OSS_WINDOW,
            rope_parameters=YARN,
            swiglu_limit=1.5,
        ),
    ),
}
# the trainer needs three distinct aux layers below the last: a fourth layer
SPECS["qwen3_moe_4"] = ("qwen3_moe", SPECS["qwen3_moe"][1] | {"num_hidden_layers": 4})


def _hf_config(family: str, overrides: dict):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=128,
        initializer_range=0.15,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        rms_norm_eps=1e-6,
    )
    common.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen3": transformers.Qwen3Config,
        "gemma3": transformers.Gemma3TextConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "gpt_oss": transformers.GptOssConfig,
    }[family]
    if family == "gemma3":
        common.setdefault("tie_word_embeddings", True)
        common["hidden_activation"] = "gelu_pytorch_tanh"
    cfg = cls(**common)
    cfg._attn_implementation = "eager"
    return cfg


def build(kind: str, folder: str | Path | None = None, seed: int = 0, **save_kwargs):
    """A random model of `kind` (a SPECS key); saved to `folder` when given."""
    import torch
    import transformers

    family, overrides = SPECS[kind]
    cfg = _hf_config(family, overrides)
    cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "gemma3": transformers.Gemma3ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "gpt_oss": transformers.GptOssForCausalLM,
    }[family]
    torch.manual_seed(seed)
    model = cls(cfg).eval().float()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # offsets differ per family; randomise around the identity
                base = 0.0 if family == "gemma3" else 1.0
                p.copy_(base + 0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith((".bias", "_bias")):  # GPT-OSS expert biases end "_bias"
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    if folder is not None:
        model.save_pretrained(str(folder), **save_kwargs)
    return model


def hf_run(model, input_ids) -> tuple[np.ndarray, list[np.ndarray]]:
    """(logits [B, T, V], hidden_states tuple as numpy) of a full forward."""
    import torch

    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(input_ids), dtype=torch.long), output_hidden_states=True)
    return out.logits.float().numpy(), [h.float().numpy() for h in out.hidden_states]


def tokens(batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(batch, length)).astype(np.int32)


def edit_config(folder: str | Path, fn) -> None:
    path = Path(folder) / "config.json"
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))


def word_tokenizer(folder) -> None:
    """A word-level tokenizer over w0..w{V-1} with a chat template, saved beside the model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    fast.chat_template = "{% for m in messages %}w2 {{ m['content'] }} w3 {% endfor %}w4"
    fast.save_pretrained(str(folder))
