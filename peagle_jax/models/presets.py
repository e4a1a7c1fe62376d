"""Built-in target shapes: the config.json fields (as Hugging Face publishes them) of the released
heads' targets, so a plan needs no download. Only shapes are read from them; no weight exists."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from peagle_jax.models import gpt_oss

__all__ = ["PRESETS", "preset_fields", "target_config"]

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _gemma3(hidden, layers, heads, kv, inter, window, vocab=262144, softcap=None, max_pos=32768):
    return {
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": 256 if hidden < 5000 else 128,
        "intermediate_size": inter,
        "vocab_size": vocab,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": window,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256 if hidden < 5000 else 168,
        "final_logit_softcapping": softcap,
        "hidden_activation": "gelu_pytorch_tanh",
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "tie_word_embeddings": True,
    }


def _gpt_oss(layers, experts):
    return {
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "num_hidden_layers": layers,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 2880,
        "num_local_experts": experts,
        "num_experts_per_tok": 4,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": gpt_oss.DEFAULT_THETA,
        "rope_scaling": dict(gpt_oss.DEFAULT_ROPE),  # GPT-OSS ships transformers' defaults
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "eos_token_id": 200002,
        "pad_token_id": 199999,
        "tie_word_embeddings": False,
    }


def _qwen3(hidden, layers, heads, kv, inter, **moe):
    return {
        "model_type": "qwen3_moe" if moe else "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": 128,
        "intermediate_size": inter,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "tie_word_embeddings": False,
        **moe,
    }


PRESETS = {
    "Llama-3.1-8B": {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_ROPE,
        "hidden_act": "silu",
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "tie_word_embeddings": False,
    },
    "Qwen3-8B": _qwen3(4096, 36, 32, 8, 12288),
    "Qwen3-30B-A3B": _qwen3(
        2048, 48, 32, 4, 6144, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True
    ),
    "Gemma-3-270M": _gemma3(640, 18, 4, 1, 2048, 512),
    "Gemma-3-1B": _gemma3(1152, 26, 4, 1, 6912, 512),
    "Gemma-3-27B": _gemma3(5376, 62, 32, 16, 21504, 1024, max_pos=131072),
    "GPT-OSS-20B": _gpt_oss(24, 32),
    "GPT-OSS-120B": _gpt_oss(36, 128),
}


def preset_fields(name: str) -> dict | None:
    """The config.json fields of a preset (its name in any case), else None."""
    preset = {k.lower(): v for k, v in PRESETS.items()}.get(str(name).lower())
    return None if preset is None else dict(preset)


def target_config(spec: str, layers: int | None):
    """The TargetConfig of a preset name or a folder (only its config.json is read)."""
    from peagle_jax.models.registry import target_config as parse

    fields = preset_fields(spec)
    if fields is None and not Path(spec).exists():
        raise ValueError(f"--target {spec!r}: neither a folder nor a preset ({', '.join(PRESETS)})")
    cfg = parse(fields if fields is not None else Path(spec))
    if layers is None:
        return cfg
    per_layer = {f: getattr(cfg, f)[:layers] for f in ("layer_types", "mlp_types") if getattr(cfg, f)}
    return dataclasses.replace(cfg, num_layers=layers, **per_layer)
